"""Builds the sandbox service's object graph from settings; the only place adapters meet the core."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from services.sandbox.core.auth import KeyRing, Tenant, tenant_keyring
from services.sandbox.core.quotas import LocalQuotas, QuotaStore
from services.sandbox.grpc_server import grpc_service
from services.sandbox.isolation import SandboxPool
from services.sandbox.rest import create_app
from services.sandbox.service import SandboxService
from services.sandbox.settings import LocalQuotaSettings, RedisQuotaSettings, SandboxSettings
from spade.serving import lifecycle
from spade.serving.grpc import RunningGrpc, grpc_server
from spade.serving.http import RunningHttp, http_server
from spade.serving.logs import get_logger

log = get_logger(__name__)


def build_authenticator(settings: SandboxSettings) -> KeyRing[Tenant]:
    """The tenants' keys (dev mode without keys: open, as the dev tenant)."""
    keys = {
        k.key_sha256: Tenant(
            name=k.tenant, max_sessions=k.max_sessions, executions_per_minute=k.executions_per_minute, role=k.role
        )
        for k in settings.api_keys
    }
    return tenant_keyring(keys, dev_mode=settings.dev_mode)


def build_quotas(settings: SandboxSettings) -> QuotaStore:
    """Where tenant quotas are counted (``settings.quotas.kind``)."""
    quotas = settings.quotas
    if isinstance(quotas, RedisQuotaSettings):
        from services.sandbox.redis_quotas import RedisQuotas

        return RedisQuotas(quotas)
    assert isinstance(quotas, LocalQuotaSettings)
    if not settings.dev_mode:
        log.warning(
            "sandbox quotas are counted per replica (quotas.kind=local): with N replicas a tenant gets N "
            'times its quota; share them with SPADE_SANDBOX_QUOTAS=\'{"kind": "redis", "url": ...}\''
        )
    return LocalQuotas()


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
        quotas=build_quotas(settings),
    )
    reaper = asyncio.create_task(service.reap_forever(settings.reap_interval_s))
    try:
        yield service
    finally:
        reaper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reaper
        lifecycle.note_finished("sandbox stopped", sessions_closed=len(service.sessions))
        await service.shutdown()
        await pool.stop()


@dataclass
class RunningServers:
    """Addresses of a started sandbox service (ports resolved when 0 was asked for)."""

    grpc: RunningGrpc
    http: RunningHttp

    @property
    def grpc_port(self) -> int:
        return self.grpc.port

    @property
    def http_port(self) -> int:
        return self.http.port


@contextlib.asynccontextmanager
async def serving(settings: SandboxSettings) -> AsyncIterator[RunningServers]:
    """Run gRPC and REST side by side on one event loop until the context exits."""
    async with (
        sandbox_service(settings) as service,
        grpc_server(
            [grpc_service(service)],
            settings.grpc,
            service="sandbox",
            authenticate=service.authenticate,
            registry=service.metrics.registry,
            max_receive_bytes=settings.max_request_bytes,
            max_send_bytes=max(settings.max_request_bytes, 64 * 2**20),
            grace_s=2.0,
        ) as grpc_running,
        http_server(
            create_app(service, max_request_bytes=settings.max_request_bytes),
            settings.http,
            service="sandbox",
            lifespan="off",
        ) as http_running,
    ):
        yield RunningServers(grpc_running, http_running)


async def serve_forever(settings: SandboxSettings, stop: asyncio.Event) -> None:
    """Entry point of ``spade serve sandbox``: serve until ``stop`` is set (SIGTERM/SIGINT)."""
    async with serving(settings) as running:
        lifecycle.started(
            f"sandbox serving: gRPC {settings.grpc.host}:{running.grpc_port}, "
            f"REST http://{settings.http.host}:{running.http_port} (OpenAPI at /docs)",
            settings=settings,
            grpc_port=running.grpc_port,
            http_port=running.http_port,
            max_sessions=settings.max_sessions,
        )
        await stop.wait()
