"""``GymnasiumEnv``: any env session as a ``gymnasium.Env`` with text spaces.

Wraps anything with the session interface — ``reset(seed) -> outcome`` and ``step(action) ->
outcome``, where an outcome has ``observation``, ``reward``, ``terminated``, ``truncated``,
``info`` (and optionally ``outcome``, ``turn``, ``max_turns``) — e.g. a local ``EnvSession`` over
trusted code or a client of a remote sandbox session. This module is the one part of
``spade.envs`` that needs a third-party package (gymnasium); it is never copied into the sandbox.
"""

from __future__ import annotations

import string
from typing import Any, Protocol

import gymnasium
from gymnasium import spaces

from spade.envs.session import EnvSession
from spade.envs.types import CheckConfig, Setting

_ACTION_CHARSET = string.ascii_letters + string.digits + string.punctuation + " "


class SessionLike(Protocol):
    """What the adapter needs from a session."""

    def reset(self, seed: int | None = None) -> Any: ...

    def step(self, action: str) -> Any: ...


class AnyText(spaces.Text):
    """A ``Text`` space that contains every string within its length bounds, whatever its
    characters (observations hold punctuation, newlines and unicode); sampling still draws from
    ``charset``."""

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and self.min_length <= len(x) <= self.max_length


class GymnasiumEnv(gymnasium.Env[str, str]):
    """A session as a Gymnasium env.

    ``reset(seed=None)`` draws a seed from the env's ``np_random`` (so repeated resets visit
    different instances); ``reset(seed=s)`` plays instance ``s``. ``info`` is the env's info plus
    ``info["spade"] = {"outcome", "turn", "max_turns"}`` when the session reports them.

    Args:
        session: the session to drive.
        max_observation_length: bound of the observation space (the session's observation cap).
        max_action_length: bound of the action space.
        render_mode: ``None`` or ``"ansi"`` (``render()`` returns the last observation).
    """

    metadata = {"render_modes": ["ansi"]}  # noqa: RUF012 - gymnasium's own class attribute

    def __init__(
        self,
        session: SessionLike,
        *,
        max_observation_length: int = CheckConfig().observation_cap,
        max_action_length: int = 4096,
        render_mode: str | None = None,
    ) -> None:
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"render_mode must be None or 'ansi', got {render_mode!r}")
        self.session = session
        self.render_mode = render_mode
        self.observation_space = AnyText(max_length=max_observation_length, min_length=0)
        self.action_space = AnyText(max_length=max_action_length, min_length=1, charset=_ACTION_CHARSET)
        self._last_observation = ""

    @classmethod
    def from_code(
        cls,
        code: str,
        setting: str | Setting,
        seed: int | None = None,
        config: CheckConfig | None = None,
        **kwargs: Any,
    ) -> GymnasiumEnv:
        """An adapter over a local ``EnvSession`` (trusted code only: it runs in this process)."""
        config = config or CheckConfig()
        session = EnvSession(code, setting, seed, config)
        return cls(session, max_observation_length=config.observation_cap, **kwargs)

    @staticmethod
    def _info(outcome: Any) -> dict[str, Any]:
        info = dict(getattr(outcome, "info", None) or {})
        extra = {k: getattr(outcome, k) for k in ("outcome", "turn", "max_turns") if hasattr(outcome, k)}
        if extra:
            if "outcome" in extra:
                extra["outcome"] = str(getattr(extra["outcome"], "value", extra["outcome"]))
            info["spade"] = extra
        return info

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        instance = seed if seed is not None else int(self.np_random.integers(0, 2**31 - 1))
        outcome = self.session.reset(instance)
        self._last_observation = str(outcome.observation)
        return self._last_observation, self._info(outcome)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        outcome = self.session.step(action)
        self._last_observation = str(outcome.observation)
        return (
            self._last_observation,
            float(outcome.reward),
            bool(outcome.terminated),
            bool(outcome.truncated),
            self._info(outcome),
        )

    def render(self) -> str | None:
        return self._last_observation if self.render_mode == "ansi" else None
