"""What a check of the env checker may use: the public ``CheckContext`` and the ``EnvCheck`` entry.

A check is a function ``check(ctx) -> detail``: it returns the detail of a pass, or raises
``CheckFailed`` whose message is the finding (rule, value seen, fix). The context gives every check
the same things and nothing else: the (repaired) code, the setting, the limits, the env class the
``structure`` check loaded, fresh sessions of it within the validation budget, guarded calls, and
the solutions recorded so far (shared so that later checks can play off-solution probes). The
checker (``spade.envs.checker``) owns the registry and the order; checks never see each other's
results.

Where the env's code runs is the context's ``runtime``: ``InProcessRuntime`` loads it into this
process (trusted code, tests); ``spade.envs.remote.RemoteRuntime`` plays every episode in a session
of its own, the very sessions a rollout plays (the sandbox's validation), so the checker never
shares a process with the code it judges and the env cannot tell a check from a play.

The seeds every check plays are drawn afresh for each validation, in secret, from the play seed
distribution (``spade.envs.seeds``): ``seeds`` for the seed-wise checks, ``random_seeds`` for the
random policy's episodes, and ``rng`` (seeded from ``os.urandom``) for the random policy's actions.
Reports name them afterwards. Standard library only.
"""

from __future__ import annotations

import contextlib
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from spade.envs.contract import ContractError
from spade.envs.findings import CheckFailed, short
from spade.envs.limits import CallTimeout, describe_exception, guarded
from spade.envs.loader import LoadResult, load_env_class
from spade.envs.policy import RandomPolicy
from spade.envs.seeds import secret_seeds
from spade.envs.session import EnvSession
from spade.envs.types import CheckConfig, Outcome, Setting, StepOutcome


class EnvRuntime(Protocol):
    """Where the env's code runs during a validation."""

    def load(self, code: str, setting: Setting, config: CheckConfig) -> LoadResult:
        """Run the module and pick its env class.

        Raises:
            CallTimeout: Running the module took longer than ``config.call_time_limit_s``.
        """
        ...

    def session(self, env_class: Any, setting: Setting, seed: int, config: CheckConfig) -> EnvSession:
        """A fresh session of the loaded env class on ``seed``, not yet reset."""
        ...

    @property
    def shares_process(self) -> bool:
        """Whether env code runs in the checker's own process (its global state then needs restoring)."""
        ...

    def guard(self, seconds: float) -> contextlib.AbstractContextManager[Any]:
        """The time limit and output capture of one env call made from the checker."""
        ...

    def seed_global(self, n: int) -> None:
        """Seed the global ``random`` module of the process the env runs in."""
        ...

    def rng_mark(self) -> Any:
        """A mark of the env process's global ``random`` state, for ``rng_touched``."""
        ...

    def rng_touched(self, mark: Any) -> bool:
        """Whether any env call changed the env process's global ``random`` state since ``mark``."""
        ...


class InProcessRuntime:
    """Env code in this very process: for trusted code (tests, the example envs)."""

    def load(self, code: str, setting: Setting, config: CheckConfig) -> LoadResult:
        with guarded(config.call_time_limit_s):
            return load_env_class(code, setting)

    def session(self, env_class: Any, setting: Setting, seed: int, config: CheckConfig) -> EnvSession:
        return EnvSession.from_class(env_class, setting, seed, config)

    shares_process = True

    def guard(self, seconds: float) -> contextlib.AbstractContextManager[Any]:
        return guarded(seconds)

    def seed_global(self, n: int) -> None:
        random.seed(n)

    def rng_mark(self) -> Any:
        return random.getstate()

    def rng_touched(self, mark: Any) -> bool:
        return bool(random.getstate() != mark)


class CheckContext:
    """The running validation of one env source, as the checks see it.

    Args:
        code: The env source after the known repairs.
        setting: Game or tool.
        config: Limits and thresholds of this validation.
        repairs: The repairs that were applied, in order (for the ``syntax`` finding).
        runtime: Where the env's code runs (``InProcessRuntime`` by default).

    Attributes:
        seeds: The ``config.seed_count`` seeds of this validation's seed-wise checks (secret, see
            the module docstring).
        random_seeds: The seeds of the random policy's ``config.random_policy_episodes`` episodes.
        rng: The checker's own RNG (the random policy's actions), seeded in secret.
        env_class: The env class, once the ``structure`` check has loaded it (``None`` before).
        solutions: Seed -> the env's solution on that seed (game: action strings; tool: one list of
            ``ToolCall`` per instruction), recorded the first time a check asks for it.
    """

    def __init__(
        self,
        code: str,
        setting: Setting,
        config: CheckConfig,
        repairs: list[str],
        runtime: EnvRuntime | None = None,
    ) -> None:
        self.runtime: EnvRuntime = runtime or InProcessRuntime()
        self.code = code
        self.setting = setting
        self.config = config
        self.repairs = list(repairs)
        drawn = secret_seeds(config.seed_count + config.random_policy_episodes)
        self.seeds: tuple[int, ...] = tuple(drawn[: config.seed_count])
        self.random_seeds: tuple[int, ...] = tuple(drawn[config.seed_count :])
        self.rng = random.Random(os.urandom(16))
        self.env_class: Any = None
        self.solutions: dict[int, Any] = {}
        self._deadline = time.monotonic() + config.total_time_limit_s

    def fresh_seeds(self, count: int) -> tuple[int, ...]:
        """``count`` more secret seeds from the play distribution, none of this validation's so far."""
        used = {*self.seeds, *self.random_seeds}
        fresh: list[int] = []
        while len(fresh) < count:
            fresh.extend(s for s in secret_seeds(count - len(fresh)) if s not in used and s not in fresh)
        return tuple(fresh)

    @property
    def over_budget(self) -> bool:
        """Whether the validation has used up ``config.total_time_limit_s``."""
        return time.monotonic() > self._deadline

    def session(self, seed: int) -> EnvSession:
        """A fresh session of the loaded env class on ``seed`` (not yet reset).

        Raises:
            CheckFailed: The validation budget is used up.
        """
        assert self.env_class is not None
        if self.over_budget:
            raise CheckFailed(
                f"validation ran past its budget of {self.config.total_time_limit_s:g} s in total; "
                "make reset()/step() cheaper"
            )
        return self.runtime.session(self.env_class, self.setting, seed, self.config)

    def guarded(self, fn: Callable[[], Any], what: str) -> Any:
        """``fn()`` under the per-call time limit; a timeout or any exception becomes a finding.

        A ``ContractError`` passes through for the caller to word (a host checks the shape of what
        ``reset``/``step`` return where the env runs, before the value can cross to the checker).
        """
        try:
            with self.runtime.guard(self.config.call_time_limit_s):
                return fn()
        except ContractError:
            raise
        except CallTimeout:
            raise CheckFailed(
                f"{what} took longer than the {self.config.call_time_limit_s:g} s per-call limit; "
                "make it cheaper (no unbounded loops or huge searches)"
            ) from None
        except (Exception, SystemExit) as exc:
            raise CheckFailed(f"{what} raised {describe_exception(exc)}") from None

    def reset(self, seed: int) -> tuple[EnvSession, StepOutcome]:
        """A fresh session reset on ``seed`` and its first outcome (a failed reset is a finding)."""
        session = self.session(seed)
        first = session.reset()
        if first.outcome is not Outcome.OK:
            raise CheckFailed(f"reset(seed={seed}): {first.observation}")
        return session, first

    def solution(self, session: EnvSession, seed: int) -> Any:
        """The env's solution for its current instance, validated, normalised and recorded."""
        env = session.env
        if self.setting is Setting.TOOL:
            blocks = self.guarded(env.solution_calls, f"solution() on seed {seed}")
            self.solutions.setdefault(seed, blocks)
            return blocks
        actions = self.guarded(env.solution, f"solution() on seed {seed}")
        if not isinstance(actions, list | tuple) or not actions or not all(isinstance(a, str) for a in actions):
            raise CheckFailed(
                f"solution() on seed {seed} must return a non-empty list of action strings, got {short(actions)}"
            )
        self.solutions.setdefault(seed, list(actions))
        return list(actions)

    def solution_of(self, seed: int) -> Any:
        """The solution of ``seed`` as recorded by an earlier check, else computed on a fresh instance
        of its own; either way never on the instance the caller then plays."""
        if seed in self.solutions:
            return self.solutions[seed]
        return self.solution(self.reset(seed)[0], seed)

    def check_turns(self, session: EnvSession, seed: int, needed: int) -> None:
        """Refuse a solution of ``needed`` turns that ``session`` cannot play out.

        The session's turn limit is the env's own ``max_turns`` clamped to the agent's budget
        (``CheckConfig.max_turns_cap``); the finding names whichever of the two binds.

        Raises:
            CheckFailed: ``needed`` is over the session's turn limit.
        """
        if needed <= session.max_turns:
            return
        budget = self.config.max_turns_cap
        if session.max_turns >= budget:
            raise CheckFailed(
                f"solution() on seed {seed} needs {needed} turns; the agent's budget is {budget} turns: "
                "make the task winnable within the budget"
            )
        raise CheckFailed(
            f"solution() on seed {seed} needs {needed} turns but the env's own max_turns is {session.max_turns}; "
            f"raise max_turns (up to the agent's budget of {budget}) or shorten the solution"
        )

    def try_solution(self, session: EnvSession, seed: int) -> Any:
        """``solution()`` or None when it fails: only ``solution_replay`` reports solution defects."""
        try:
            return self.solution(session, seed)
        except CheckFailed:
            return None

    def as_actions(self, solution: Any) -> list[str]:
        """A solution as the action strings an agent would send."""
        if solution is None:
            return []
        if self.setting is Setting.TOOL:
            return [call.to_text() for block in solution for call in block]
        return list(solution)

    def policy(self, rng: random.Random, exclude_seed: int | None = None) -> RandomPolicy:
        """A random policy that also replays other seeds' recorded solution steps."""
        others = [s for seed, s in sorted(self.solutions.items()) if seed != exclude_seed]
        tools = self.env_class.tool_schemas() if self.setting is Setting.TOOL and self.env_class else {}
        return RandomPolicy(self.setting, rng, others, tools)


@dataclass(frozen=True)
class EnvCheck:
    """One entry of the checker's registry.

    Attributes:
        name: The check's name (one of ``CHECK_NAMES``).
        run: The check: ``run(ctx)`` returns the pass detail or raises ``CheckFailed``.
        needs: The check that must have passed for this one to run (``None``: always runs).
        tool_only: Whether the check applies to tool envs only (game envs pass it as not applicable).
    """

    name: str
    run: Callable[[CheckContext], str]
    needs: str | None = None
    tool_only: bool = False
