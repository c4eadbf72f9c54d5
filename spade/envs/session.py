"""``EnvSession``: one env instance played turn by turn under the framework's rules.

The sandbox runtime drives sessions through this class (and the checker plays through it too):

- every ``reset()`` builds a fresh instance of the env class, so nothing leaks between episodes;
- game actions are normalised with ``normalize_game_action``; tool actions go to ``ToolEnv.step``;
- ``max_turns`` is the env's own, capped by ``CheckConfig.max_turns_cap``; when the cap is hit and
  the env has not ended the episode, the step is ``truncated`` with ``Outcome.LIMIT``;
- rewards are clamped to [0, 1]; the episode return is the terminal reward, 0 when truncated;
- an exception or a contract violation in env code gives ``Outcome.ENV_ERROR``, a call over the
  time limit ``Outcome.TIMEOUT`` and a ``MemoryError`` ``Outcome.MEMORY_LIMIT``, each with a short
  message as the observation (no framework traceback) and the episode ended (``truncated``,
  reward 0);
- observations are cut to ``CheckConfig.observation_cap`` characters and ``info`` is made
  JSON-safe;
- ``step()`` before ``reset()`` or after the episode ended raises ``SessionError``.

Standard library only.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

from spade.envs.actions import normalize_game_action
from spade.envs.contract import ContractError, unpack_reset, unpack_step
from spade.envs.limits import CallTimeout, describe_exception, guarded
from spade.envs.loader import load_env_class
from spade.envs.repair import repair_code
from spade.envs.types import CheckConfig, Outcome, Setting, StepOutcome

T = TypeVar("T")


class EnvLoadError(ValueError):
    """The code does not define a loadable env; the message lists the findings.

    Attributes:
        env_class: The env class the findings are about, when one was found.
    """

    env_class: type | None = None


class SessionError(RuntimeError):
    """A session was driven out of order (step before reset, step after the episode ended)."""


class EnvFault(Exception):
    """Env code raised, broke the contract or ran over its time limit (``outcome`` says which)."""

    def __init__(self, outcome: Outcome, message: str) -> None:
        super().__init__(message)
        self.outcome = outcome
        self.message = message


def jsonable(value: Any) -> Any:
    """``value`` made JSON-safe (unknown objects become their ``str``)."""
    try:
        return json.loads(json.dumps(value, default=str, allow_nan=False))
    except (TypeError, ValueError):
        return {"unserialisable": repr(value)[:200]}


def cap_text(text: str, cap: int) -> str:
    """``text`` cut to ``cap`` characters, with a marker saying how much was dropped."""
    if len(text) <= cap:
        return text
    marker = f"\n...[observation cut: {len(text) - cap} more characters]"
    return text[: max(cap - len(marker), 0)] + marker


class EnvSession:
    """One env, one seed, played turn by turn (see the module docstring for the rules).

    Args:
        code: env source (the known repairs are applied first).
        setting: ``"game"`` or ``"tool"``.
        seed: the seed ``reset()`` uses unless given another.
        config: limits; ``CheckConfig()`` by default.

    Raises:
        EnvLoadError: when the code does not load or defines no single valid env class.

    Example:
        >>> from spade.envs.examples import EXAMPLES
        >>> s = EnvSession(EXAMPLES["code_breaker"].code, "game", seed=3)
        >>> s.reset().turn, s.step("\\\\boxed{guess 1 2 3 4}").outcome.value
        (0, 'ok')
    """

    def __init__(
        self, code: str, setting: str | Setting, seed: int | None = None, config: CheckConfig | None = None
    ) -> None:
        config = config or CheckConfig()
        repaired, _ = repair_code(code)
        try:
            with guarded(config.call_time_limit_s):
                loaded = load_env_class(repaired, setting)
        except CallTimeout:
            raise EnvLoadError(f"loading the env code took longer than {config.call_time_limit_s:g} s") from None
        if not loaded.ok or loaded.env_class is None:
            raise EnvLoadError("; ".join(loaded.problems))
        self._init(loaded.env_class, Setting.parse(setting), seed, config)

    @classmethod
    def from_class(
        cls, env_class: type, setting: str | Setting, seed: int | None = None, config: CheckConfig | None = None
    ) -> EnvSession:
        """A session over an already-loaded env class (trusted or already-sandboxed code)."""
        session = cls.__new__(cls)
        session._init(env_class, Setting.parse(setting), seed, config or CheckConfig())
        return session

    def _init(self, env_class: type, setting: Setting, seed: int | None, config: CheckConfig) -> None:
        self.env_class = env_class
        self.setting = setting
        self.seed = seed
        self.config = config
        self.env: Any = None
        self.turn = 0
        self.max_turns = config.effective_max_turns(getattr(env_class, "max_turns", None))
        self.last: StepOutcome | None = None
        self.raw: dict[str, Any] = {}
        """What the env's last call returned before the framework cut and clamped it: ``reward``
        and the observation's length in ``chars`` (empty after a fault)."""

    # --- state ---------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        """Whether the current episode has ended (or none has started)."""
        return self.last is None or self.last.done

    @property
    def episode_return(self) -> float:
        """The terminal reward of the finished episode, 0 when truncated or not finished."""
        return self.last.episode_return if self.last is not None and self.last.done else 0.0

    def guarded_call(self, fn: Callable[..., T], *args: Any) -> T:
        """Call env code under the time limit; env failures become ``EnvFault``.

        A ``ContractError`` passes through for the caller to word (an env class served from another
        process checks the shape of its answers there).
        """
        try:
            with guarded(self.config.call_time_limit_s):
                return fn(*args)
        except ContractError:
            raise
        except CallTimeout:
            raise EnvFault(
                Outcome.TIMEOUT, f"the env took longer than {self.config.call_time_limit_s:g} s to answer"
            ) from None
        except MemoryError:
            raise EnvFault(Outcome.MEMORY_LIMIT, "the env ran out of its memory limit") from None
        except (Exception, SystemExit) as exc:  # env code calling exit() must not end the process
            raise EnvFault(Outcome.ENV_ERROR, describe_exception(exc)) from None

    def _safe_info(self, info: dict[str, Any]) -> dict[str, Any]:
        """``info`` made JSON-safe, with tool outputs cut to the observation cap like observations."""
        safe = jsonable(info)
        if not isinstance(safe, dict):
            return {}
        for result in safe.get("tool_results") or []:
            if isinstance(result, dict) and isinstance(result.get("output"), str):
                result["output"] = cap_text(result["output"], self.config.observation_cap)
        return safe

    # --- play ----------------------------------------------------------------------------
    def _fault(self, where: str, fault: EnvFault) -> StepOutcome:
        self.raw = {}
        prefix = {Outcome.TIMEOUT: "Environment timeout", Outcome.MEMORY_LIMIT: "Environment out of memory"}.get(
            fault.outcome, "Environment error"
        )
        self.last = StepOutcome(
            observation=f"{prefix} in {where}: {fault.message}",
            reward=0.0,
            terminated=False,
            truncated=True,
            info={},
            turn=self.turn,
            max_turns=self.max_turns,
            outcome=fault.outcome,
        )
        return self.last

    def reset(self, seed: int | None = None) -> StepOutcome:
        """Start a new episode on a fresh instance (``seed`` overrides the session's seed)."""
        if seed is not None:
            self.seed = seed
        self.turn = 0
        try:
            self.env = self.guarded_call(self.env_class)
            declared = getattr(self.env, "max_turns", None)
            self.max_turns = self.config.effective_max_turns(declared)
            raw = self.guarded_call(lambda: self.env.reset(seed=self.seed))
            observation, info = unpack_reset(raw)
        except EnvFault as fault:
            return self._fault("reset()", fault)
        except ContractError as exc:
            return self._fault("reset()", EnvFault(Outcome.ENV_ERROR, str(exc)))
        self.raw = {"reward": 0.0, "chars": len(observation)}
        self.last = StepOutcome(
            observation=cap_text(observation, self.config.observation_cap),
            reward=0.0,
            terminated=False,
            truncated=False,
            info=self._safe_info(info),
            turn=0,
            max_turns=self.max_turns,
            outcome=Outcome.OK,
        )
        return self.last

    def _check_step(self, action: object) -> None:
        """Refuse a step before ``reset()``, after the episode ended, or with an action that is not a str."""
        if self.last is None:
            raise SessionError("step() called before reset(); call reset() first")
        if self.last.done:
            how = "terminated" if self.last.terminated else "truncated"
            raise SessionError(
                f"the episode already ended ({how} at turn {self.last.turn}); call reset() to start a new one"
            )
        if not isinstance(action, str):
            raise TypeError(f"action must be a str, got {type(action).__name__}")

    def step(self, action: str) -> StepOutcome:
        """Play one turn.

        Raises:
            SessionError: before ``reset()`` or after the episode ended.
            TypeError: when ``action`` is not a str.
        """
        self._check_step(action)
        if self.setting is Setting.GAME:
            action = normalize_game_action(action)
        self.turn += 1
        try:
            raw = self.guarded_call(self.env.step, action)
            observation, reward, terminated, truncated, info = unpack_step(raw)
        except EnvFault as fault:
            return self._fault("step()", fault)
        except ContractError as exc:
            return self._fault("step()", EnvFault(Outcome.ENV_ERROR, str(exc)))
        self.raw = {"reward": reward, "chars": len(observation)}
        outcome = Outcome.OK
        if not terminated and not truncated and self.turn >= self.max_turns:
            truncated, outcome = True, Outcome.LIMIT
        self.last = StepOutcome(
            observation=cap_text(observation, self.config.observation_cap),
            reward=min(max(reward, 0.0), 1.0),
            terminated=terminated,
            truncated=truncated and not terminated,
            info=self._safe_info(info),
            turn=self.turn,
            max_turns=self.max_turns,
            outcome=outcome,
        )
        return self.last
