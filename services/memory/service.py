"""``MemoryService``: the memory's application API, async, over the SQL store and the policy.

This is what the gRPC servicer and REST routes call, and what other services call directly in
embedded mode (``MemoryClient`` offers the same methods over gRPC in distributed mode). Database work
runs in worker threads so an event loop is never blocked.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence

from services.memory.core.policy import PolicyConfig, choose, with_code
from services.memory.store.sql import SqlStore
from spade.memory.records import (
    EnvFilter,
    Environment,
    Examples,
    MemoryStats,
    NewEnvironment,
    Page,
    Play,
    PutResult,
    RecordResult,
    StatsUpdate,
)


class MemoryService:
    """The environment memory.

    Args:
        store: The SQL store (migrated).
        policy: Bands and counts of the designer's examples.
    """

    def __init__(self, store: SqlStore, policy: PolicyConfig | None = None) -> None:
        self.store = store
        self.policy = policy or PolicyConfig()

    async def put_environment(self, env: NewEnvironment) -> PutResult:
        """Store an environment; a duplicate (same normalised code) is reported, not stored."""
        return await asyncio.to_thread(self.store.put_environment, env)

    async def get_environment(self, env_id: str) -> Environment:
        """One environment with its statistics (raises ``EnvironmentNotFound``)."""
        return await asyncio.to_thread(self.store.get_environment, env_id)

    async def list_environments(self, f: EnvFilter | None = None, limit: int = 50, cursor: str | None = None) -> Page:
        """A page of environments, newest first; pass ``page.next_cursor`` back for the next one."""
        return await asyncio.to_thread(self.store.list_environments, f or EnvFilter(), limit, cursor)

    async def record_plays(self, plays: Sequence[Play]) -> RecordResult:
        """Record plays (idempotent by trajectory id) and update the touched environments' statistics."""
        return await asyncio.to_thread(self.store.record_plays, list(plays))

    async def update_stats(self, env_id: str, update: StatsUpdate) -> Environment:
        """Store the learner's reward components / learnable flag / status for one environment."""
        return await asyncio.to_thread(self.store.update_stats, env_id, update)

    async def sample_examples(
        self, setting: str, skill: str, n_positive: int, n_negative: int, seed: int | None = None
    ) -> Examples:
        """Positive and negative examples for a designer prompt (see ``core.policy``).

        Args:
            setting: ``"game"`` or ``"tool"``.
            skill: The skill being designed for.
            n_positive: Positives wanted.
            n_negative: Negatives wanted.
            seed: Makes the draw reproducible; a fresh random seed when ``None``.
        """
        window = await asyncio.to_thread(self.store.scored_window, setting, skill, self.policy.window)
        draw_seed = random.SystemRandom().randrange(2**63) if seed is None else seed
        picks = choose(window, n_positive, n_negative, draw_seed, self.policy)
        code = await asyncio.to_thread(self.store.codes, picks.env_ids())
        return with_code(picks, code, self.policy)

    async def stats(self) -> MemoryStats:
        """Aggregates over the whole memory."""
        return await asyncio.to_thread(self.store.stats)

    async def plays(self, env_id: str, limit: int = 200, cursor: str | None = None) -> tuple[list[Play], str | None]:
        """Plays of one environment, newest first, and the next page's cursor."""
        return await asyncio.to_thread(self.store.plays, env_id, limit, cursor)
