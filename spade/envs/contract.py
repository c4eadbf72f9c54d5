r"""The game-env contract (DESIGN §3) as a Protocol, an optional base class, and the shape checks
the session and the checker share.

A game env is one class whose name ends in ``Env``::

    reset(seed: int | None = None) -> (observation: str, info: dict)
    step(action: str) -> (observation: str, reward: float, terminated: bool, truncated: bool, info: dict)
    solution() -> list[str]     # actions that win the instance built by the last reset()
    max_turns: int              # optional, capped by configuration

All randomness comes from ``seed`` through an instance-local ``random.Random(seed)``, never the
global ``random`` module; the same seed and actions give the same observations; reward is 1.0 for
a win and partial rewards lie in [0, 1]; the episode return is the terminal reward (0 when
truncated). Actions arrive normalised as ``\boxed{X}``. Standard library only.
"""

from __future__ import annotations

import math
import random
from typing import Any, Protocol, runtime_checkable


class ContractError(ValueError):
    """An env returned something that breaks the contract; the message says what and the fix."""


@runtime_checkable
class GameEnvContract(Protocol):
    """What a game env provides (``max_turns`` is optional)."""

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]: ...

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]: ...

    def solution(self) -> list[str]: ...


class GameEnv:
    """Optional base class of game envs: a seeded ``self.rng``, a turn counter and ``max_turns``.

    Subclasses call ``self.begin(seed)`` at the start of ``reset`` and ``self.tick()`` at the start
    of ``step`` (which returns True once the turn limit is reached), and implement
    ``reset``/``step``/``solution``.
    """

    max_turns: int = 20

    def __init__(self) -> None:
        self.rng = random.Random(0)
        self.turn = 0

    def begin(self, seed: int | None) -> random.Random:
        """Start an episode: a fresh ``random.Random(seed)`` in ``self.rng``, turn 0."""
        self.rng = random.Random(seed)
        self.turn = 0
        return self.rng

    def tick(self) -> bool:
        """Count one turn; True when this turn reaches ``max_turns`` (time to truncate)."""
        self.turn += 1
        return self.turn >= self.max_turns

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        raise NotImplementedError(f"{type(self).__name__} must implement reset(self, seed=None)")

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        raise NotImplementedError(f"{type(self).__name__} must implement step(self, action)")

    def solution(self) -> list[str]:
        raise NotImplementedError(f"{type(self).__name__} must implement solution(self)")


def as_flag(value: Any, name: str) -> bool:
    """A ``terminated``/``truncated`` flag as ``bool``: Python bools, numpy-style bools
    (anything whose ``.item()`` is a bool) and the ints 0/1 are accepted."""
    if isinstance(value, bool):
        return value
    item = getattr(value, "item", None)
    if callable(item) and type(value).__name__.startswith("bool"):
        try:
            inner = item()
        except Exception:
            inner = None
        if isinstance(inner, bool):
            return inner
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ContractError(f"{name} must be a bool, got {type(value).__name__} {value!r:.40}")


def as_reward(value: Any) -> float:
    """The reward as a finite ``float`` (ints and numpy-style scalars accepted)."""
    if isinstance(value, bool):
        raise ContractError(f"reward must be a number, got bool {value!r}; return 1.0 or 0.0")
    try:
        reward = float(value)
    except (TypeError, ValueError):
        raise ContractError(f"reward must be a number, got {type(value).__name__} {value!r:.40}") from None
    if not math.isfinite(reward):
        raise ContractError(f"reward must be finite, got {reward!r}")
    return reward


def unpack_reset(result: Any) -> tuple[str, dict[str, Any]]:
    """``(observation, info)`` from what ``reset()`` returned; a bare string is tolerated."""
    if isinstance(result, str):
        return result, {}
    if not isinstance(result, tuple) or len(result) != 2:
        shape = f"a tuple of {len(result)}" if isinstance(result, tuple) else type(result).__name__
        raise ContractError(f"reset() must return (observation: str, info: dict), got {shape}")
    observation, info = result
    if not isinstance(observation, str):
        raise ContractError(f"reset() observation must be a str, got {type(observation).__name__}")
    if info is None:
        info = {}
    if not isinstance(info, dict):
        raise ContractError(f"reset() info must be a dict, got {type(info).__name__}")
    return observation, info


def unpack_step(result: Any) -> tuple[str, float, bool, bool, dict[str, Any]]:
    """``(observation, reward, terminated, truncated, info)`` from what ``step()`` returned."""
    if not isinstance(result, tuple) or len(result) != 5:
        shape = f"a tuple of {len(result)}" if isinstance(result, tuple) else type(result).__name__
        raise ContractError(f"step() must return (observation, reward, terminated, truncated, info), got {shape}")
    observation, reward, terminated, truncated, info = result
    if not isinstance(observation, str):
        raise ContractError(f"step() observation must be a str, got {type(observation).__name__}")
    if info is None:
        info = {}
    if not isinstance(info, dict):
        raise ContractError(f"step() info must be a dict, got {type(info).__name__}")
    return (
        observation,
        as_reward(reward),
        as_flag(terminated, "terminated"),
        as_flag(truncated, "truncated"),
        info,
    )
