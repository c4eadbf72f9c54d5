"""What the rollout core needs from the memory, as small protocols and plain domain values.

Each protocol is implemented by an adapter (the memory store or its gRPC client) and by nothing else
in the core. What playing one env needs (sessions, generation, templates) is the agent's:
``spade.agent.ports``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from spade.agent.ports import EnvSpec


class EnvNotFound(LookupError):
    """The memory has no env with the id ``envs.ready`` named (raised by ``EnvSource`` adapters)."""


class EnvSource(Protocol):
    """Reads envs from the memory (raises ``EnvNotFound`` for an unknown id)."""

    async def get_environment(self, env_id: str) -> EnvSpec: ...


@dataclass(frozen=True)
class Window:
    """An env's window as the memory stores it: slot 0 at ``start``, ``versions`` slots in all."""

    start: int
    versions: int


class WindowKeeper(Protocol):
    """Fixes an env's window in the memory (WAVE2 §3)."""

    async def set_window(self, env_id: str, window_start: int, window_versions: int) -> Window:
        """Store the window unless one is stored already (first writer wins); return the stored one."""
        ...


@dataclass(frozen=True)
class PlayRecord:
    """One finished play as the memory records it.

    Attributes:
        sample_id: Deterministic id of the play; also the ``AgentSample.sample_id`` (idempotency key).
        env_id: The env played.
        seed: The reset seed.
        hinted: Whether the hint was appended to the first observation.
        episode_return: The terminal reward (0 unless terminated).
        turns: Model turns taken.
        weight_version: Oldest weight version among the play's model tokens (the slot's version when
            it has none): what generated it, never what it is scored under.
        finish_reason: How the play ended (a ``spade.envs.types.FinishReason`` value).
        window_start: The env's window start (the memory's stored window).
        window_index: The window slot the play belongs to (0..k-1): what it is scored under.
        spec_id: The run spec it was played under.
    """

    sample_id: str
    env_id: str
    seed: int
    hinted: bool
    episode_return: float
    turns: int
    weight_version: int
    finish_reason: str
    window_start: int
    window_index: int
    spec_id: str


class PlayLog(Protocol):
    """Records plays and retirements in the memory."""

    async def record_plays(self, env_id: str, plays: Sequence[PlayRecord]) -> None:
        """Store plays; re-recording a ``sample_id`` must not duplicate it."""
        ...

    async def retire_environment(self, env_id: str, last_version: int, *, trivially_won: bool = False) -> None:
        """Mark the env's window closed (its designer sample can be scored); ``trivially_won``: its audit
        plays retired it (``core/audit.py``)."""
        ...


class RolloutMemory(EnvSource, WindowKeeper, PlayLog, Protocol):
    """Everything the worker needs from the memory: env code, windows, plays and retirements."""
