"""Result and configuration types of the environment contract library.

Everything here crosses the sandbox boundary as JSON, so every type has ``to_dict()`` and
``from_dict()``. Standard library only: this package is copied into the sandbox.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from enum import StrEnum
from typing import Any


class Setting(StrEnum):
    """Which kind of environment a piece of code is (DESIGN §1)."""

    GAME = "game"
    TOOL = "tool"

    @classmethod
    def parse(cls, value: str | Setting) -> Setting:
        """Turn ``"game"``/``"tool"`` (or a ``Setting``) into a ``Setting``.

        Raises:
            ValueError: naming the bad value and the accepted ones.
        """
        if isinstance(value, Setting):
            return value
        try:
            return cls(str(value).strip().lower())
        except ValueError:
            raise ValueError(f"setting must be 'game' or 'tool', got {value!r}") from None


SETTINGS: tuple[str, ...] = tuple(member.value for member in Setting)
"""Every setting's name (``("game", "tool")``): the choices of a ``--setting`` option."""


class Outcome(StrEnum):
    """How one ``reset()``/``step()`` call ended (STYLE habit 4).

    - ``ok``: the env answered; read ``terminated``/``truncated`` for the episode state.
    - ``env_error``: the env code raised or returned something that breaks the contract.
    - ``timeout``: the call ran past the per-call wall-clock limit.
    - ``limit``: the framework ended the episode at its ``max_turns`` cap (the env did not).
    - ``cpu_limit``: the env's process used up its CPU-time limit.
    - ``memory_limit``: the env's process ran out of its memory limit.
    - ``output_limit``: the env produced an observation or output over its size cap.
    - ``killed``: the env's process was killed by a signal nobody asked for.
    - ``sandbox_fault``: the sandbox itself failed (set by the sandbox runtime, never by env code).
    """

    OK = "ok"
    ENV_ERROR = "env_error"
    TIMEOUT = "timeout"
    LIMIT = "limit"
    CPU_LIMIT = "cpu_limit"
    MEMORY_LIMIT = "memory_limit"
    OUTPUT_LIMIT = "output_limit"
    KILLED = "killed"
    SANDBOX_FAULT = "sandbox_fault"


class FinishReason(StrEnum):
    """How a whole play ended, end to end: sandbox -> rollout -> samples -> memory -> metrics.

    One definition for every service. Only ``terminated`` plays carry the env's terminal reward as
    their return; every other reason gives return 0. Resource faults are the env's fault but not a
    turn cap: they are never reported as ``truncated``, and the learner treats them as configured.
    """

    TERMINATED = "terminated"
    """The env ended the episode (win or loss): the return is its terminal reward."""
    TRUNCATED = "truncated"
    """The env truncated the episode itself (its own turn limit, clamped to the agent's budget)."""
    TURN_LIMIT = "turn_limit"
    """The agent's turn budget (the run spec's) ended the play."""
    TOKEN_LIMIT = "token_limit"
    """The agent's token budget ran out."""
    ENV_ERROR = "env_error"
    """The env raised or broke the contract."""
    FAULT_WALL_CLOCK = "fault_wall_clock"
    """An env call ran past its wall-clock limit."""
    FAULT_CPU = "fault_cpu"
    """The env used up its CPU-time limit."""
    FAULT_MEMORY = "fault_memory"
    """The env ran out of its memory limit."""
    FAULT_OUTPUT = "fault_output"
    """The env produced output over its cap."""
    FAULT_KILLED = "fault_killed"
    """The env's process was killed by an unexpected signal."""

    @property
    def is_resource_fault(self) -> bool:
        """Whether the play ended because the env hit a resource limit."""
        return self.value.startswith("fault_")

    @classmethod
    def stored(cls, value: str) -> FinishReason | None:
        """A stored finish reason; ``""`` (a play recorded without one) and a value this code does not
        know (an older producer's) are None, which is not a resource fault, as
        :meth:`names_resource_fault` reads them.

        >>> FinishReason.stored("fault_cpu"), FinishReason.stored(""), FinishReason.stored("stop")
        (<FinishReason.FAULT_CPU: 'fault_cpu'>, None, None)
        """
        try:
            return cls(value) if value else None
        except ValueError:
            return None

    @classmethod
    def names_resource_fault(cls, finish_reason: str | None) -> bool:
        """Whether a stored or received finish reason is a resource fault; unknown, empty or missing
        ones (older producers) are not.

        >>> FinishReason.names_resource_fault("fault_memory"), FinishReason.names_resource_fault("")
        (True, False)
        """
        if finish_reason is None:
            return False
        try:
            return cls(finish_reason).is_resource_fault
        except ValueError:
            return False

    @classmethod
    def for_outcome(cls, outcome: Outcome) -> FinishReason:
        """The play's finish reason when a call ended with a failing ``outcome``.

        Raises:
            ValueError: ``outcome`` is ``ok`` (read the step's flags instead) or ``sandbox_fault``
                (an infrastructure failure: retry the play, never record it as the env's).
        """
        try:
            return _FAILED_CALL[outcome]
        except KeyError:
            raise ValueError(
                f"outcome {outcome.value!r} does not end a play by itself: 'ok' is read from the step's "
                "flags, and a 'sandbox_fault' is retried, never recorded as the env's"
            ) from None


_FAILED_CALL: dict[Outcome, FinishReason] = {
    Outcome.ENV_ERROR: FinishReason.ENV_ERROR,
    Outcome.TIMEOUT: FinishReason.FAULT_WALL_CLOCK,
    Outcome.LIMIT: FinishReason.TURN_LIMIT,
    Outcome.CPU_LIMIT: FinishReason.FAULT_CPU,
    Outcome.MEMORY_LIMIT: FinishReason.FAULT_MEMORY,
    Outcome.OUTPUT_LIMIT: FinishReason.FAULT_OUTPUT,
    Outcome.KILLED: FinishReason.FAULT_KILLED,
}


CHECK_NAMES: tuple[str, ...] = (
    "syntax",
    "structure",
    "smoke",
    "determinism",
    "seed_variety",
    "solution_replay",
    "random_policy",
    "termination",
    "reset_gate",
    "irrelevant_action",
)
"""Every validation check of DESIGN §4, in the order the checker runs them."""


@dataclass(frozen=True)
class CheckResult:
    """One named validation check and why it passed or failed.

    Attributes:
        name: one of ``CHECK_NAMES``.
        passed: whether the env passed this check.
        detail: human-readable finding: the rule, the value seen and the fix.
    """

    name: str
    passed: bool
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CheckResult:
        return cls(name=str(data["name"]), passed=bool(data["passed"]), detail=str(data.get("detail", "")))


@dataclass(frozen=True)
class ValidationReport:
    """Everything the checker found about one env source.

    Attributes:
        valid: True only when every check in ``checks`` passed.
        setting: ``"game"`` or ``"tool"``.
        env_class: name of the env class found, ``""`` when none was.
        checks: one ``CheckResult`` per name in ``CHECK_NAMES``, in that order.
        repaired_code: the code after the known repairs (what a session loads).
        duration_ms: wall time the checker took.
    """

    valid: bool
    setting: str
    env_class: str
    checks: list[CheckResult]
    repaired_code: str
    duration_ms: float = 0.0

    def check(self, name: str) -> CheckResult:
        """The result of the check called ``name``.

        Raises:
            KeyError: if no check has that name.
        """
        for result in self.checks:
            if result.name == name:
                return result
        raise KeyError(f"no check named {name!r}; checks are {', '.join(CHECK_NAMES)}")

    @property
    def failed(self) -> list[CheckResult]:
        """The checks that did not pass, in order."""
        return [c for c in self.checks if not c.passed]

    def summary(self) -> str:
        """One line per failed check (or ``"valid"``), for logs and designer feedback."""
        if self.valid:
            return "valid"
        return "\n".join(f"{c.name}: {c.detail}" for c in self.failed)

    def to_dict(self) -> dict[str, Any]:
        return {
            "valid": self.valid,
            "setting": self.setting,
            "env_class": self.env_class,
            "checks": [c.to_dict() for c in self.checks],
            "repaired_code": self.repaired_code,
            "duration_ms": self.duration_ms,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ValidationReport:
        return cls(
            valid=bool(data["valid"]),
            setting=str(data["setting"]),
            env_class=str(data.get("env_class", "")),
            checks=[CheckResult.from_dict(c) for c in data.get("checks", [])],
            repaired_code=str(data.get("repaired_code", "")),
            duration_ms=float(data.get("duration_ms", 0.0)),
        )


@dataclass(frozen=True)
class CheckConfig:
    """Limits and thresholds shared by the checker and ``EnvSession``.

    Attributes:
        seed_count: how many seeds every seed-wise check tries (2..64). Each validation draws them
            afresh and in secret from the play seed distribution (``spade.envs.seeds``), so no env
            can know them; the report names them afterwards. Default 4.
        call_time_limit_s: wall-clock limit of one ``reset()``/``step()``/``solution()`` call, in
            seconds (0 < x <= 60). Default 2.0.
        max_turns_cap: the agent's turn budget (the run spec's ``agent_max_turns``; see
            ``with_turn_budget``): no session runs past it, an env's ``max_turns`` above it is
            clamped, and ``solution()`` must win within it (1..1000). Default 25, as in the paper.
        default_max_turns: ``max_turns`` of an env that declares none (capped by
            ``max_turns_cap``). Default 25.
        random_policy_episodes: episodes the random/no-op policy plays (1..1000). Default 20.
        random_policy_max_win_rate: highest win rate a random/no-op policy may reach before the env
            counts as trivial or hackable (0..1). Default 0.15, as the reference's offline check.
        (The random policy's own actions and its episodes' seeds are drawn in secret too.)
        observation_cap: longest observation, in characters, a session passes on (longer ones are
            cut) and the smoke check accepts (100..1_000_000). Default 8000.
        win_threshold: a terminal reward at or above this counts as a win (0 < x <= 1). Default 1.0.
        max_irrelevant_probes: at most this many off-solution calls are tried per instruction by
            the ``irrelevant_action`` check (1..1000). Default 24.
        total_time_limit_s: wall-clock budget of one whole validation, in seconds (0 < x <= 3600);
            checks still to run when it is spent fail saying so. Default 60.
    """

    seed_count: int = 4
    call_time_limit_s: float = 2.0
    max_turns_cap: int = 25
    default_max_turns: int = 25
    random_policy_episodes: int = 20
    random_policy_max_win_rate: float = 0.15
    observation_cap: int = 8000
    win_threshold: float = 1.0
    max_irrelevant_probes: int = 24
    total_time_limit_s: float = 60.0

    def __post_init__(self) -> None:
        problems = []
        if isinstance(self.seed_count, bool) or not isinstance(self.seed_count, int) or not 2 <= self.seed_count <= 64:
            problems.append(f"seed_count must be an int in [2, 64], got {self.seed_count!r}")
        if not (0 < self.call_time_limit_s <= 60):
            problems.append(f"call_time_limit_s must be in (0, 60], got {self.call_time_limit_s!r}")
        if not (1 <= self.max_turns_cap <= 1000):
            problems.append(f"max_turns_cap must be in [1, 1000], got {self.max_turns_cap!r}")
        if not (1 <= self.default_max_turns <= 1000):
            problems.append(f"default_max_turns must be in [1, 1000], got {self.default_max_turns!r}")
        if not (1 <= self.random_policy_episodes <= 1000):
            problems.append(f"random_policy_episodes must be in [1, 1000], got {self.random_policy_episodes!r}")
        if not (0 <= self.random_policy_max_win_rate <= 1):
            problems.append(f"random_policy_max_win_rate must be in [0, 1], got {self.random_policy_max_win_rate!r}")
        if not (100 <= self.observation_cap <= 1_000_000):
            problems.append(f"observation_cap must be in [100, 1000000], got {self.observation_cap!r}")
        if not (0 < self.win_threshold <= 1):
            problems.append(f"win_threshold must be in (0, 1], got {self.win_threshold!r}")
        if not (1 <= self.max_irrelevant_probes <= 1000):
            problems.append(f"max_irrelevant_probes must be in [1, 1000], got {self.max_irrelevant_probes!r}")
        if not (0 < self.total_time_limit_s <= 3600):
            problems.append(f"total_time_limit_s must be in (0, 3600], got {self.total_time_limit_s!r}")
        if problems:
            raise ValueError("invalid CheckConfig: " + "; ".join(problems))

    def with_turn_budget(self, turns: int) -> CheckConfig:
        """This config with the agent's turn budget ``turns`` (the run spec's ``agent_max_turns``) as
        ``max_turns_cap``: ``solution()`` must win within it, and no session runs past it.

        >>> CheckConfig().with_turn_budget(8).max_turns_cap, CheckConfig().with_turn_budget(8).default_max_turns
        (8, 8)
        """
        return replace(self, max_turns_cap=turns, default_max_turns=min(self.default_max_turns, turns))

    def effective_max_turns(self, declared: object) -> int:
        """The ``max_turns`` a session enforces for an env that declares ``declared``.

        >>> CheckConfig().effective_max_turns(40)
        25
        >>> CheckConfig().effective_max_turns(None)
        25
        """
        if isinstance(declared, bool) or not isinstance(declared, int) or declared < 1:
            return min(self.default_max_turns, self.max_turns_cap)
        return min(declared, self.max_turns_cap)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CheckConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            secret = [name for name in ("seeds", "random_policy_seed") if name in unknown]
            why = (
                f" ({', '.join(secret)}: validation draws its seeds in secret for each run; set seed_count)"
                if secret
                else ""
            )
            raise ValueError(f"unknown CheckConfig fields {unknown}{why}; known fields are {sorted(known)}")
        return cls(**data)


@dataclass
class StepOutcome:
    """What one ``reset()`` or ``step()`` of a session produced.

    Attributes:
        observation: text for the agent (cut to the observation cap; on ``env_error``/``timeout`` a
            short message saying what went wrong).
        reward: the step's reward, clamped to [0, 1]; 0 after ``reset()``.
        terminated: the env ended the episode (win or loss).
        truncated: the episode was cut short (turn limit, env error or timeout).
        info: the env's info dict, made JSON-safe. Tool envs carry ``tools`` after reset and
            ``new_instruction`` when an instruction completes.
        turn: steps taken so far in this episode (0 after reset).
        max_turns: the turn limit this session enforces.
        outcome: how the call ended (``Outcome``).
    """

    observation: str
    reward: float
    terminated: bool
    truncated: bool
    info: dict[str, Any]
    turn: int
    max_turns: int
    outcome: Outcome = Outcome.OK

    @property
    def done(self) -> bool:
        """Whether the episode is over (terminated or truncated)."""
        return self.terminated or self.truncated

    @property
    def episode_return(self) -> float:
        """The episode return if this is the last step: the terminal reward, 0 when truncated."""
        return self.reward if self.terminated else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "observation": self.observation,
            "reward": self.reward,
            "terminated": self.terminated,
            "truncated": self.truncated,
            "info": self.info,
            "turn": self.turn,
            "max_turns": self.max_turns,
            "outcome": self.outcome.value,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepOutcome:
        reward = float(data.get("reward", 0.0))
        if not math.isfinite(reward):
            raise ValueError(f"reward must be finite, got {reward!r}")
        return cls(
            observation=str(data.get("observation", "")),
            reward=reward,
            terminated=bool(data.get("terminated", False)),
            truncated=bool(data.get("truncated", False)),
            info=dict(data.get("info") or {}),
            turn=int(data.get("turn", 0)),
            max_turns=int(data.get("max_turns", 0)),
            outcome=Outcome(data.get("outcome", "ok")),
        )
