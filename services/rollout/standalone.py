"""The composition root of ``spade serve rollout``: the in-process variants a worker's settings ask for.

A rollout worker reaches the memory and the sandbox as services (``kind: grpc``, the deployment's
case) through the clients of ``spade/``, which ``services.rollout.wiring`` builds itself. A worker may
instead open them in its own process, as a laptop or a test does: the memory's database directly
(``memory: {kind: sql, url}``, migrated on start) and an isolated sandbox pool (``sandbox: {kind:
pool}``). Those are another service's internals, so they are built here, in the process's composition
root (the import contracts of pyproject.toml allow it here and nowhere else in the rollout), and
handed to ``rollout_worker``; the embedded run (``services/embedded``) hands in its own.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from services.rollout.memory import MemoryApi
from services.rollout.sandbox import PoolSessions
from services.rollout.settings import RolloutSettings, SqlMemory
from services.rollout.wiring import rollout_worker
from services.rollout.worker import RolloutWorker
from spade.agent.ports import SessionOpener
from spade.endpoints import PoolSandbox


@contextlib.asynccontextmanager
async def standalone_worker(
    settings: RolloutSettings, *, stop: asyncio.Event | None = None
) -> AsyncIterator[RolloutWorker]:
    """``rollout_worker(settings)`` with the in-process memory and sandbox the settings ask for built here.

    ``stop`` is passed on (SIGTERM while waiting at start). Everything opened here is closed on exit.
    An in-process pool starts before the run spec is checked, so a contradicting setting (exit 2)
    starts and stops it first.
    """
    async with contextlib.AsyncExitStack() as stack:
        memory = _sql_memory(settings.memory, stack) if isinstance(settings.memory, SqlMemory) else None
        sessions = await _pool_sessions(settings.sandbox, stack) if isinstance(settings.sandbox, PoolSandbox) else None
        async with rollout_worker(settings, stop=stop, memory=memory, sessions=sessions) as worker:
            yield worker


def _sql_memory(cfg: SqlMemory, stack: contextlib.AsyncExitStack) -> MemoryApi:
    from services.memory.service import MemoryService
    from services.memory.store.sql import SqlStore, make_engine, migrate

    engine = make_engine(cfg.url)
    stack.callback(engine.dispose)
    migrate(engine)
    return MemoryService(SqlStore(engine))


async def _pool_sessions(cfg: PoolSandbox, stack: contextlib.AsyncExitStack) -> SessionOpener:
    from services.sandbox.isolation import SandboxPool
    from services.sandbox.isolation.settings import IsolationSettings

    pool = SandboxPool(IsolationSettings.model_validate(cfg.isolation))
    await pool.start()
    stack.push_async_callback(pool.stop)
    return PoolSessions(pool, cfg.checks)
