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
from spade.memory import records


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


class PlayLog(Protocol):
    """Records plays and retirements in the memory."""

    async def record_plays(self, env_id: str, plays: Sequence[records.Play]) -> None:
        """Store plays (the memory's own record); re-recording a ``trajectory_id`` must not duplicate it."""
        ...

    async def retire_environment(self, env_id: str, last_version: int, *, trivially_won: bool = False) -> None:
        """Mark the env's window closed (its designer sample can be scored); ``trivially_won``: its audit
        plays retired it (``core/audit.py``)."""
        ...


class RolloutMemory(EnvSource, WindowKeeper, PlayLog, Protocol):
    """Everything the worker needs from the memory: env code, windows, plays and retirements."""
