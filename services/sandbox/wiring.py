"""Builds the sandbox service's object graph from settings; the only place adapters meet the core."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import uvicorn

from services.sandbox.core.auth import Authenticator, Tenant
from services.sandbox.grpc_server import create_server
from services.sandbox.isolation import SandboxPool
from services.sandbox.rest import create_app
from services.sandbox.service import SandboxService
from services.sandbox.settings import SandboxSettings

log = logging.getLogger("spade.sandbox")


def build_authenticator(settings: SandboxSettings) -> Authenticator:
    keys = {
        k.key_sha256: Tenant(name=k.tenant, max_sessions=k.max_sessions, executions_per_minute=k.executions_per_minute)
        for k in settings.api_keys
    }
    return Authenticator(keys, allow_anonymous=settings.dev_mode and not keys)


@contextlib.asynccontextmanager
async def sandbox_service(settings: SandboxSettings) -> AsyncIterator[SandboxService]:
    """Start the isolated worker pool and yield the service; stops everything on exit."""
    pool = SandboxPool(settings.isolation)
    await pool.start()
    service = SandboxService(
        pool,
        build_authenticator(settings),
        settings.request_limits(),
        settings.checks,
        session_ttl_s=settings.session_ttl_s,
        max_sessions=settings.max_sessions,
    )
    reaper = asyncio.create_task(service.reap_forever(settings.reap_interval_s))
    try:
        yield service
    finally:
        reaper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reaper
        await service.shutdown()
        await pool.stop()


@dataclass
class RunningServers:
    """Addresses of a started sandbox service (ports resolved when 0 was asked for)."""

    grpc_port: int
    http_port: int
    grpc_server: grpc.aio.Server
    http_server: uvicorn.Server


@contextlib.asynccontextmanager
async def serving(settings: SandboxSettings) -> AsyncIterator[RunningServers]:
    """Run gRPC and REST side by side on one event loop until the context exits."""
    async with sandbox_service(settings) as service:
        grpc_server = create_server(service, max_message_bytes=settings.max_request_bytes)
        grpc_port = grpc_server.add_insecure_port(f"{settings.host}:{settings.grpc_port}")
        await grpc_server.start()
        app = create_app(service, max_request_bytes=settings.max_request_bytes)
        config = uvicorn.Config(app, host=settings.host, port=settings.http_port, log_level="warning", lifespan="off")
        http_server = uvicorn.Server(config)
        http_task = asyncio.create_task(http_server.serve())
        while not http_server.started:
            if http_task.done():
                await http_task
                raise RuntimeError(f"REST server failed to start on {settings.host}:{settings.http_port}")
            await asyncio.sleep(0.01)
        http_port = http_server.servers[0].sockets[0].getsockname()[1]
        try:
            yield RunningServers(grpc_port, http_port, grpc_server, http_server)
        finally:
            http_server.should_exit = True
            await http_task
            await grpc_server.stop(grace=2.0)


async def serve_forever(settings: SandboxSettings) -> None:
    """Entry point of ``spade serve sandbox``: serve until SIGINT/SIGTERM."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with serving(settings) as running:
        log.warning(
            "sandbox serving: gRPC %s:%d, REST http://%s:%d (OpenAPI at /docs)",
            settings.host,
            running.grpc_port,
            settings.host,
            running.http_port,
        )
        await stop.wait()
