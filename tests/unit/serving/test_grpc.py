"""The shared gRPC bootstrap against a real server on port 0: health, reflection, auth, errors, metrics."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client import CollectorRegistry

from spade.auth import KeyRing, hash_key
from spade.errors import ErrorKind, ServiceError
from spade.serving.grpc import GrpcService, RunningGrpc, caller, grpc_server
from spade.serving.settings import ServerAddress
from spade.v1 import sandbox_pb2, sandbox_pb2_grpc

KEY = "k-alice"
AUTH = (("authorization", f"Bearer {KEY}"),)


class Refused(ServiceError):
    kind = ErrorKind.QUOTA
    code = "quota_exceeded"


class Demo(sandbox_pb2_grpc.SandboxServicer):
    """Answers with the caller's name; 'refuse' and 'crash' fail as a domain error and as a bug."""

    async def Validate(  # noqa: N802
        self, request: sandbox_pb2.ValidateRequest, context: object
    ) -> sandbox_pb2.ValidationReport:
        if request.code == "refuse":
            raise Refused("over the quota of 2 runs a minute: wait, or ask for a higher quota")
        if request.code == "crash":
            raise KeyError("secret internal detail")
        return sandbox_pb2.ValidationReport(env_class=str(caller()))

    async def Play(  # noqa: N802
        self, request_iterator: AsyncIterator[sandbox_pb2.PlayRequest], context: object
    ) -> AsyncIterator[sandbox_pb2.PlayResponse]:
        async for message in request_iterator:
            state = sandbox_pb2.SessionState(observation=f"{caller()}:{message.action}")
            yield sandbox_pb2.PlayResponse(state=state)


SANDBOX = sandbox_pb2.DESCRIPTOR.services_by_name["Sandbox"].full_name


@pytest.fixture
async def served() -> AsyncIterator[tuple[RunningGrpc, CollectorRegistry]]:
    registry = CollectorRegistry()
    ring = KeyRing({hash_key(KEY): "alice"})
    demo = GrpcService(SANDBOX, lambda server: sandbox_pb2_grpc.add_SandboxServicer_to_server(Demo(), server))
    async with grpc_server(
        [demo], ServerAddress(port=0), service="demo", authenticate=ring.authenticate, registry=registry
    ) as running:
        yield running, registry


@pytest.fixture
async def channel(served: tuple[RunningGrpc, CollectorRegistry]) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{served[0].port}") as ch:
        yield ch


async def test_health_and_reflection_are_served_without_a_key(channel: grpc.aio.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    for name in ("", SANDBOX):
        reply = await health.Check(health_pb2.HealthCheckRequest(service=name))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)

    async def ask() -> AsyncIterator[reflection_pb2.ServerReflectionRequest]:
        yield reflection_pb2.ServerReflectionRequest(list_services="")

    names = set()
    async for answer in stub.ServerReflectionInfo(ask()):
        names |= {s.name for s in answer.list_services_response.service}
    assert {SANDBOX, "grpc.health.v1.Health"} <= names


async def test_the_caller_is_authenticated_and_known_to_the_servicer(channel: grpc.aio.Channel) -> None:
    stub = sandbox_pb2_grpc.SandboxStub(channel)
    assert (await stub.Validate(sandbox_pb2.ValidateRequest(code="x"), metadata=AUTH)).env_class == "alice"
    for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", "Basic abc"),)):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Validate(sandbox_pb2.ValidateRequest(code="x"), metadata=metadata)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "key" in (info.value.details() or "").lower()


async def test_a_stream_is_authenticated_once_its_first_message_is_in(channel: grpc.aio.Channel) -> None:
    stub = sandbox_pb2_grpc.SandboxStub(channel)

    async def actions() -> AsyncIterator[sandbox_pb2.PlayRequest]:
        for action in ("a", "b"):
            yield sandbox_pb2.PlayRequest(action=action)

    seen = [r.state.observation async for r in stub.Play(actions(), metadata=AUTH)]
    assert seen == ["alice:a", "alice:b"]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in stub.Play(actions()):
            pass
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED  # the real status, not INTERNAL


async def test_errors_map_to_statuses_in_one_place_and_internals_stay_inside(
    channel: grpc.aio.Channel, served: tuple[RunningGrpc, CollectorRegistry]
) -> None:
    stub = sandbox_pb2_grpc.SandboxStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.Validate(sandbox_pb2.ValidateRequest(code="refuse"), metadata=AUTH)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "over the quota" in (refused.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as crashed:
        await stub.Validate(sandbox_pb2.ValidateRequest(code="crash"), metadata=AUTH)
    assert crashed.value.code() == grpc.StatusCode.INTERNAL
    assert "secret" not in (crashed.value.details() or "") and "demo service" in (crashed.value.details() or "")
    registry = served[1]
    counts = {
        code: registry.get_sample_value("spade_demo_grpc_requests_total", {"method": "Validate", "code": code})
        for code in ("RESOURCE_EXHAUSTED", "INTERNAL")
    }
    assert counts == {"RESOURCE_EXHAUSTED": 1.0, "INTERNAL": 1.0}


async def test_a_taken_port_is_a_clear_error(served: tuple[RunningGrpc, CollectorRegistry]) -> None:
    with pytest.raises(OSError, match="is the port free"):
        async with grpc_server([], ServerAddress(port=served[0].port), service="other"):
            pass
