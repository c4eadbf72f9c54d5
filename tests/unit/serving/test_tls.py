"""TLS and mutual TLS from settings: gRPC and HTTPS round trips with generated certificates, through the
real clients (sandbox, memory, inference); plaintext and strangers' certificates refused."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import ValidationError

from spade.auth import KeyRing, hash_key
from spade.endpoints import SandboxEndpoint
from spade.inference.client import InferenceClient, InferenceUnavailable
from spade.memory.client import MemoryClient
from spade.retry import RetryPolicy
from spade.sandbox.client import SandboxClient
from spade.sandbox.errors import SandboxFault
from spade.sandbox.sync_client import SyncSandboxClient
from spade.serving.grpc import GrpcService, caller, grpc_server
from spade.serving.http import http_server, install_error_handlers
from spade.serving.settings import ServerAddress
from spade.serving.tls import ClientTls, ServerTls
from spade.v1 import memory_pb2, memory_pb2_grpc, sandbox_pb2, sandbox_pb2_grpc, types_pb2
from tests.unit.serving.certs import Pki, make_pki

KEY = "k-tls"
ONE_TRY = RetryPolicy(attempts=1, initial_s=0.01, multiplier=1.0, max_s=0.01, jitter_s=0.0)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


class Sandbox(sandbox_pb2_grpc.SandboxServicer):
    async def Validate(  # noqa: N802
        self, request: sandbox_pb2.ValidateRequest, context: object
    ) -> sandbox_pb2.ValidationReport:
        return sandbox_pb2.ValidationReport(env_class=f"{caller()}:{request.code}", setting=types_pb2.SETTING_GAME)


class Memory(memory_pb2_grpc.MemoryServicer):
    async def GetRunSpec(  # noqa: N802
        self, request: memory_pb2.GetRunSpecRequest, context: grpc.aio.ServicerContext
    ) -> memory_pb2.RunSpecRecord:
        await context.abort(grpc.StatusCode.NOT_FOUND, f"no run spec for {caller()}")
        raise AssertionError("unreachable")


def services() -> list[GrpcService]:
    return [
        GrpcService(
            sandbox_pb2.DESCRIPTOR.services_by_name["Sandbox"].full_name,
            lambda s: sandbox_pb2_grpc.add_SandboxServicer_to_server(Sandbox(), s),
        ),
        GrpcService(
            memory_pb2.DESCRIPTOR.services_by_name["Memory"].full_name,
            lambda s: memory_pb2_grpc.add_MemoryServicer_to_server(Memory(), s),
        ),
    ]


def server_tls(pki: Pki, *, mutual: bool) -> ServerTls:
    return ServerTls(cert_file=pki.server_cert, key_file=pki.server_key, client_ca_file=pki.ca if mutual else None)


async def validate(target: str, tls: ClientTls | None) -> str:
    endpoint = SandboxEndpoint(target=target, api_key=KEY, tls=tls, timeout_s=10, retry=ONE_TRY)
    async with SandboxClient.from_endpoint(endpoint) as client:
        return (await client.validate("code", "game")).env_class


async def test_grpc_over_tls_with_the_servers_ca_and_never_in_plaintext(pki: Pki) -> None:
    ring = KeyRing({hash_key(KEY): "alice"})
    bind = ServerAddress(port=0, tls=server_tls(pki, mutual=False))
    async with grpc_server(services(), bind, service="demo", authenticate=ring.authenticate) as running:
        target = f"127.0.0.1:{running.port}"
        assert await validate(target, ClientTls(ca_file=pki.ca)) == "alice:code"

        def blocking() -> str:  # in a thread: the server answers on this test's event loop
            with SyncSandboxClient(target, KEY, timeout_s=10, retry=ONE_TRY, tls=ClientTls(ca_file=pki.ca)) as sync:
                return sync.validate("code", "game").env_class

        assert await asyncio.to_thread(blocking) == "alice:code"
        with pytest.raises(SandboxFault):  # a plaintext client gets no answer from a TLS port
            await validate(target, None)
        with pytest.raises(SandboxFault):  # a server whose certificate no trusted CA signed is not trusted
            await validate(target, ClientTls(ca_file=pki.rogue_ca))
        # The memory's client too, with its own error for an unknown run spec (the call went through).
        memory = MemoryClient(target, timeout_s=10, api_key=KEY, tls=ClientTls(ca_file=pki.ca))
        try:
            with pytest.raises(Exception, match="alice"):
                await memory.get_run_spec()
        finally:
            await memory.close()


async def test_grpc_mutual_tls_refuses_clients_without_a_certificate_of_its_ca(pki: Pki) -> None:
    ring = KeyRing({hash_key(KEY): "alice"})
    bind = ServerAddress(port=0, tls=server_tls(pki, mutual=True))
    async with grpc_server(services(), bind, service="demo", authenticate=ring.authenticate) as running:
        target = f"127.0.0.1:{running.port}"
        good = ClientTls(ca_file=pki.ca, cert_file=pki.client_cert, key_file=pki.client_key)
        assert await validate(target, good) == "alice:code"
        for refused in (
            ClientTls(ca_file=pki.ca),  # no certificate
            ClientTls(ca_file=pki.ca, cert_file=pki.rogue_cert, key_file=pki.rogue_key),  # a stranger's
        ):
            with pytest.raises(SandboxFault):
                await validate(target, refused)
        # The certificate is not a key: a good certificate with no bearer key is still unauthenticated.
        async with grpc.aio.secure_channel(target, good.grpc_credentials()) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await sandbox_pb2_grpc.SandboxStub(channel).Validate(sandbox_pb2.ValidateRequest(code="x"))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def https_app() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app, service="demo")

    @app.get("/health_generate")
    async def health() -> PlainTextResponse:
        return PlainTextResponse("")

    return app


@pytest.fixture
async def https(pki: Pki) -> AsyncIterator[dict[str, Any]]:
    servers: dict[str, Any] = {}
    async with (
        http_server(https_app(), ServerAddress(port=0, tls=server_tls(pki, mutual=False)), service="demo") as tls,
        http_server(https_app(), ServerAddress(port=0, tls=server_tls(pki, mutual=True)), service="demo") as mtls,
    ):
        servers["tls"] = f"https://127.0.0.1:{tls.port}"
        servers["mtls"] = f"https://127.0.0.1:{mtls.port}"
        yield servers


async def ready(url: str, tls: ClientTls | None) -> None:
    async with InferenceClient([url], tls=tls, retry=ONE_TRY, timeout_s=10, connect_timeout_s=5) as client:
        await client.wait_ready(timeout_s=0.5, poll_s=0.1)


async def test_https_and_mutual_tls_through_the_inference_client(pki: Pki, https: dict[str, Any]) -> None:
    await ready(https["tls"], ClientTls(ca_file=pki.ca))
    with pytest.raises(InferenceUnavailable):
        await ready(https["tls"], None)  # the system's CAs never signed the test server's certificate
    async with httpx.AsyncClient() as plain:
        with pytest.raises(httpx.HTTPError):  # plaintext HTTP to an HTTPS port
            await plain.get(https["tls"].replace("https", "http") + "/health_generate")

    await ready(https["mtls"], ClientTls(ca_file=pki.ca, cert_file=pki.client_cert, key_file=pki.client_key))
    for refused in (
        ClientTls(ca_file=pki.ca),
        ClientTls(ca_file=pki.ca, cert_file=pki.rogue_cert, key_file=pki.rogue_key),
    ):
        with pytest.raises(InferenceUnavailable):
            await ready(https["mtls"], refused)


def test_tls_settings_name_missing_files_and_half_pairs(tmp_path: Path, pki: Pki) -> None:
    with pytest.raises(ValidationError, match="cert_file"):
        ServerAddress.model_validate({"tls": {"cert_file": str(tmp_path / "missing.crt"), "key_file": str(pki.ca)}})
    with pytest.raises(ValidationError, match="set both for mutual TLS"):
        ClientTls(cert_file=pki.client_cert)
    bind = ServerAddress.model_validate(
        {"port": 1, "tls": {"cert_file": str(pki.server_cert), "key_file": str(pki.server_key)}}
    )
    assert bind.secure and bind.tls is not None and not bind.tls.mutual
