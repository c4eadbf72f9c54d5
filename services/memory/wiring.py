"""Builds the memory's object graph from settings: the only place adapters meet the core."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI
from sqlalchemy.engine import make_url

from services.memory.service import MemoryService
from services.memory.settings import MemorySettings
from services.memory.store.sql import SqlStore, make_engine, migrate
from spade.memory.errors import RunSpecNotSet
from spade.memory.runspec import load_spec_file
from spade.memory.wire import GRPC_OPTIONS
from spade.pool_metrics import Executor
from spade.runspec import RunSpec
from spade.serving import lifecycle
from spade.serving.grpc import RunningGrpc, grpc_server
from spade.serving.http import RunningHttp, http_server
from spade.serving.logs import get_logger

log = get_logger(__name__)


@dataclass
class MemoryApp:
    """The wired service and its REST app (``serving`` starts the servers)."""

    settings: MemorySettings
    service: MemoryService
    rest: FastAPI

    def close(self) -> None:
        """Release the database connections."""
        self.service.store.engine.dispose()


def build_service(settings: MemorySettings, spec: RunSpec | None = None) -> MemoryService:
    """The store (migrated when configured), policy and run spec from settings.

    Args:
        settings: The memory's settings.
        spec: The run spec (embedded mode builds it once and hands it to every service); otherwise
            ``settings.run_spec_file``'s, when given. It is stored when none is, and checked against
            the memory's own settings; a stored spec is checked the same way.

    Raises:
        RunSpecConflict: The given spec differs from the stored one, or a spec contradicts the
            memory's own settings (each field named): the memory refuses to start.
        ConfigError: The spec file is unreadable or invalid.
    """
    from spade.pool_metrics import MiniLMEmbedder

    engine = make_engine(settings.database_url)
    if settings.migrate_on_start:
        migrate(engine)
    store = SqlStore(
        engine,
        window_versions=settings.window_defaults(),
        embedder=MiniLMEmbedder() if settings.vendi else None,
        metrics_window=settings.metrics_window,
        content_env_ids=settings.content_env_ids,
    )
    service = MemoryService(store, settings.policy(), configured=settings.spec_overlap())
    try:
        if spec is None and settings.run_spec_file is not None:
            spec = load_spec_file(settings.run_spec_file)
        if spec is not None:
            service.check_spec(spec)
            store.set_run_spec(spec)
        else:
            try:
                service.check_spec(RunSpec.from_json(store.get_run_spec().spec_json))
            except RunSpecNotSet:
                log.info("no run spec stored yet: `spade runspec set FILE` stores one")
    except Exception:
        engine.dispose()
        raise
    return service


def build(settings: MemorySettings) -> MemoryApp:
    """Everything ``spade serve memory`` runs."""
    from services.memory.rest import create_app

    service = build_service(settings)
    return MemoryApp(settings=settings, service=service, rest=create_app(service, settings))


@dataclass
class RunningServers:
    """A started memory service: both servers, their ports resolved when 0 was asked."""

    app: MemoryApp
    grpc: RunningGrpc
    http: RunningHttp


@contextlib.asynccontextmanager
async def serving(settings: MemorySettings) -> AsyncIterator[RunningServers]:
    """Run the gRPC API and the REST API + web page on one event loop until the context exits."""
    from services.memory.grpc_server import grpc_service

    app = build(settings)
    options = dict(GRPC_OPTIONS)
    try:
        async with (
            grpc_server(
                [grpc_service(app.service)],
                settings.grpc,
                service="memory",
                authenticate=settings.keyring().authenticate,
                registry=app.rest.state.registry,
                max_receive_bytes=options["grpc.max_receive_message_length"],
                max_send_bytes=options["grpc.max_send_message_length"],
            ) as grpc_running,
            http_server(app.rest, settings.http, service="memory", log_level="info") as http_running,
        ):
            yield RunningServers(app, grpc_running, http_running)
    finally:
        app.close()


def _warm_stats(service: MemoryService) -> None:
    try:
        service.store.stats()
    except Exception:
        log.warning("computing the first statistics failed; /v1/stats will try again", exc_info=True)


async def probe_forever(service: MemoryService, executor: Executor, every_s: float, stop: asyncio.Event) -> None:
    """Probe new pool envs through the sandbox until ``stop`` is set (the env code runs only there).

    A sandbox that fails is logged and tried again at the next round; nothing here stops serving.
    """
    while not stop.is_set():
        try:
            probed = await service.probe_pending(executor)
            if probed:
                log.info("probed %d pool environments in the sandbox", probed)
        except Exception:
            log.warning("probing pool environments failed; retrying in %.0f s", every_s, exc_info=True)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=every_s)


async def serve_forever(settings: MemorySettings, stop: asyncio.Event) -> None:
    """Entry point of ``spade serve memory``: serve until ``stop`` is set (SIGTERM/SIGINT)."""
    async with contextlib.AsyncExitStack() as stack:
        running = await stack.enter_async_context(serving(settings))
        lifecycle.started(
            f"memory serving: gRPC {settings.grpc.host}:{running.grpc.port}, "
            f"REST http://{settings.http.host}:{running.http.port} (OpenAPI at /docs)",
            settings=settings,
            grpc_port=running.grpc.port,
            http_port=running.http.port,
            database=make_url(settings.database_url).render_as_string(hide_password=True),
        )
        if settings.vendi:
            # Load the embedding model now, not in the first /v1/stats request. A daemon thread: a
            # SIGTERM during the (slow) load must not wait for it.
            threading.Thread(
                target=_warm_stats, args=(running.app.service,), name="memory-stats-warmup", daemon=True
            ).start()
        if settings.sandbox is not None:
            from spade.sandbox.client import SandboxClient

            cfg = settings.sandbox
            sandbox = SandboxClient.from_endpoint(cfg)
            stack.push_async_callback(sandbox.close)
            prober = asyncio.create_task(probe_forever(running.app.service, sandbox, settings.probe_every_s, stop))
            stack.push_async_callback(lambda: asyncio.wait_for(prober, timeout=60))
        await stop.wait()
