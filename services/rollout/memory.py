"""The memory as the rollout sees it: env code and hint in; windows, plays and retirements out.

Works over anything with the memory's async API — ``MemoryService`` in embedded mode, the gRPC
``MemoryClient`` in distributed mode — so the rollout never knows which one it talks to.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from services.rollout.core.ports import EnvNotFound, Window
from spade.agent.ports import EnvSpec
from spade.memory.errors import EnvironmentNotFound
from spade.memory.records import Environment, EnvStatus, Play, RecordResult, StatsUpdate


class MemoryApi(Protocol):
    """The part of the memory's API the rollout uses."""

    async def get_environment(self, env_id: str) -> Environment: ...

    async def set_window(self, env_id: str, window_start: int, window_versions: int) -> Environment: ...

    async def record_plays(self, plays: Sequence[Play]) -> RecordResult: ...

    async def update_stats(self, env_id: str, update: StatsUpdate) -> Environment: ...


class MemoryServicePlays:
    """The rollout's port to the memory (``RolloutMemory``) over the memory service's API.

    Translates, nothing more: the memory's ``Environment`` into the core's ``EnvSpec`` and
    ``Window``, a retirement into a status update (plays are the memory's own ``Play`` already).

    Args:
        memory: ``MemoryService`` or ``MemoryClient``.
    """

    def __init__(self, memory: MemoryApi) -> None:
        self._memory = memory

    async def get_environment(self, env_id: str) -> EnvSpec:
        """The env's code and hint.

        Raises:
            EnvNotFound: The memory has no such env (the ``envs.ready`` message is dropped).
        """
        try:
            env = await self._memory.get_environment(env_id)
        except EnvironmentNotFound as exc:
            raise EnvNotFound(str(exc)) from exc
        return EnvSpec(env_id=env.id, setting=env.setting, skill=env.skill, code=env.code, hint=env.hint)

    async def set_window(self, env_id: str, window_start: int, window_versions: int) -> Window:
        """Fix the env's window (first writer wins); the stored window, whoever wrote it.

        Raises:
            EnvNotFound: The memory has no such env.
        """
        try:
            env = await self._memory.set_window(env_id, window_start, window_versions)
        except EnvironmentNotFound as exc:
            raise EnvNotFound(str(exc)) from exc
        if env.window_start is None:
            raise RuntimeError(f"the memory answered SetWindow for {env_id} without a window; it must store one")
        return Window(start=env.window_start, versions=env.window_versions)

    async def record_plays(self, env_id: str, plays: Sequence[Play]) -> None:
        """Record plays (the memory stores each trajectory id once)."""
        await self._memory.record_plays(plays)

    async def retire_environment(self, env_id: str, last_version: int, *, trivially_won: bool = False) -> None:
        """Move the env to ``retired`` (its window closed), or to ``trivially_won`` (its audit retired it)."""
        status = EnvStatus.TRIVIALLY_WON if trivially_won else EnvStatus.RETIRED
        await self._memory.update_stats(env_id, StatsUpdate(status=status))
