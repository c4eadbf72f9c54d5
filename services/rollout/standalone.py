"""The composition root of ``spade serve rollout``: the in-process variants a worker's settings ask for.

A rollout worker reaches the memory and the sandbox as services (``kind: grpc``, the deployment's
case) through the clients of ``spade/``, which ``services.rollout.wiring`` builds itself. A worker may
instead open them in its own process, as a laptop or a test does: the memory's database directly
(``memory: {kind: sql, url}``, migrated on start) and an isolated sandbox pool (``sandbox: {kind:
pool}``). Those are another service's internals, so they are built here, in the process's composition
root (the import contracts of pyproject.toml allow it here and nowhere else in the rollout), by
openers ``rollout_worker`` calls at the point of its start-up where it would build the clients; the
embedded run (``services/embedded``) hands in its own parts.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from functools import partial

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
    """``rollout_worker(settings)`` with openers for the in-process memory and sandbox the settings ask for.

    The wiring calls them where it would build the clients: the memory after the state database and
    the queue answer, the sandbox pool only once the run spec is checked (a contradicting setting exits
    before any jail starts). ``stop`` is passed on (SIGTERM while waiting at start). Everything opened is
    closed on exit.
    """
    memory, sandbox = settings.memory, settings.sandbox
    async with rollout_worker(
        settings,
        stop=stop,
        open_memory=partial(_sql_memory, memory) if isinstance(memory, SqlMemory) else None,
        open_sessions=partial(_pool_sessions, sandbox) if isinstance(sandbox, PoolSandbox) else None,
    ) as worker:
        yield worker


async def _sql_memory(cfg: SqlMemory, stack: contextlib.AsyncExitStack) -> MemoryApi:
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
