"""``MemoryService``: the memory's application API, async, over the SQL store and the policy.

This is what the gRPC servicer and REST routes call, and what other services call directly in
embedded mode (``MemoryClient`` offers the same methods over gRPC in distributed mode). Database work
runs in worker threads so an event loop is never blocked.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Mapping, Sequence
from typing import Any

from services.memory.core.policy import PolicyConfig, choose, with_code
from services.memory.store.sql import SqlStore
from spade import pool_metrics
from spade.memory.errors import RunSpecConflict
from spade.memory.records import (
    DesignerAttempt,
    EnvFilter,
    Environment,
    EnvProbe,
    Examples,
    MemoryStats,
    NewEnvironment,
    Page,
    Play,
    PutResult,
    RecordResult,
    RunSpecRecord,
    StatsUpdate,
)
from spade.runspec import RunSpec
from spade.serving.logs import get_logger

log = get_logger(__name__)


class MemoryService:
    """The environment memory.

    Args:
        store: The SQL store (migrated).
        policy: Counts and sizes of the designer's examples.
        configured: The memory's own settings that overlap the run spec (spec field name -> value,
            ``None``: take the spec's); a spec that contradicts them is refused.
    """

    def __init__(
        self,
        store: SqlStore,
        policy: PolicyConfig | None = None,
        configured: Mapping[str, Any] | None = None,
    ) -> None:
        self.store = store
        self.policy = policy or PolicyConfig()
        self.configured = dict(configured or {})

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

    async def set_window(self, env_id: str, window_start: int, window_versions: int) -> Environment:
        """Fix the env's window (WAVE2 §3); the first writer wins and everyone gets the stored window.

        Args:
            env_id: The environment.
            window_start: The rollout's weight version when it first plays the env (slot 0).
            window_versions: ``k``: how many versions (slots) the window spans.

        Returns:
            The environment with its stored window (another caller's, when it came first).
        """
        return await asyncio.to_thread(self.store.set_window, env_id, window_start, window_versions)

    async def record_attempts(self, attempts: Sequence[DesignerAttempt]) -> RecordResult:
        """Record designer attempts, valid or not (idempotent by sample id), for the validity figures."""
        return await asyncio.to_thread(self.store.record_attempts, list(attempts))

    async def get_run_spec(self) -> RunSpecRecord:
        """The stored run spec (raises ``RunSpecNotSet`` before one is set)."""
        return await asyncio.to_thread(self.store.get_run_spec)

    async def set_run_spec(self, spec: RunSpec, replace: bool = False) -> RunSpecRecord:
        """Store the run spec; the same one again is a no-op, a different one needs ``replace``.

        Raises:
            RunSpecConflict: Another spec is stored (and not ``replace``), or ``spec`` contradicts the
                memory's own configuration (each field named).
        """
        self.check_spec(spec)
        record = await asyncio.to_thread(self.store.set_run_spec, spec, replace)
        log.info("run spec %s stored", record.spec_id, extra={"spec_id": record.spec_id})
        return record

    def check_spec(self, spec: RunSpec) -> None:
        """Refuse a spec that the memory's own settings contradict (one sentence per field).

        Raises:
            RunSpecConflict: Names each contradicting field, its configured and its spec value.
        """
        problems = spec.contradictions(self.configured)
        if problems:
            raise RunSpecConflict(
                "the memory's configuration contradicts the run spec: "
                + "; ".join(problems)
                + " — unset the memory's setting (it then takes the spec's) or fix the spec"
            )

    async def record_probe(self, probe: EnvProbe) -> None:
        """Keep what a sandboxed reset of an env showed (first observation, hidden state, leakage)."""
        await asyncio.to_thread(self.store.record_probe, probe)

    async def probe_pending(self, executor: pool_metrics.Executor, limit: int = 32) -> int:
        """Probe pool envs never probed, through ``executor`` (a sandbox), and keep the results.

        The env code runs only in the sandbox (``spade.pool_metrics.probe_env``), never in this
        process. Returns how many envs were probed.
        """
        pending = await asyncio.to_thread(self.store.unprobed, limit)
        for env_id, setting, code in pending:
            found = await pool_metrics.probe_env(executor, code, setting)
            await self.record_probe(
                EnvProbe(
                    env_id=env_id,
                    first_observation=found.first_observation,
                    hidden_attributes=dict(found.hidden_attributes),
                    solution=tuple(found.solution),
                    error=found.error,
                )
            )
        return len(pending)

    async def stats(self, max_age_s: float = 0.0) -> MemoryStats:
        """Aggregates and the pool's process metrics (cached until the database changes).

        ``(await memory.stats()).metrics()`` gives the flat figures of one ``metrics.jsonl`` line.

        Args:
            max_age_s: Accept cached figures this old without looking for changes (0: always current).
        """
        return await asyncio.to_thread(self.store.stats, max_age_s)

    async def plays(self, env_id: str, limit: int = 200, cursor: str | None = None) -> tuple[list[Play], str | None]:
        """Plays of one environment, newest first, and the next page's cursor."""
        return await asyncio.to_thread(self.store.plays, env_id, limit, cursor)
