"""The shared gRPC bootstrap against a real server on port 0: health, reflection, auth, errors, metrics."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

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

    def counts() -> dict[str, float | None]:
        return {
            code: registry.get_sample_value("spade_demo_grpc_requests_total", {"method": "Validate", "code": code})
            for code in ("RESOURCE_EXHAUSTED", "INTERNAL")
        }

    # The server counts a call after its status has gone out (the abort ends the call first), so the
    # client can hear the status before the count lands: wait for it (a missing count never lands).
    deadline = asyncio.get_running_loop().time() + 10
    while counts() != {"RESOURCE_EXHAUSTED": 1.0, "INTERNAL": 1.0} and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.01)
    assert counts() == {"RESOURCE_EXHAUSTED": 1.0, "INTERNAL": 1.0}


async def test_a_taken_port_is_a_clear_error(served: tuple[RunningGrpc, CollectorRegistry]) -> None:
    with pytest.raises(OSError, match="is the port free"):
        async with grpc_server([], ServerAddress(port=served[0].port), service="other"):
            pass


def _trailers(error: grpc.aio.AioRpcError) -> dict[str, str]:
    pairs: Any = error.trailing_metadata() or ()
    return {str(key): str(value) for key, value in pairs}


async def test_a_malformed_message_is_invalid_argument_after_authentication(channel: grpc.aio.Channel) -> None:
    """grpc.aio answers UNKNOWN to bytes its deserializer refuses; the interceptor answers INVALID_ARGUMENT."""
    validate = channel.unary_unary(f"/{SANDBOX}/Validate", None, None)
    for data in (b"\xff\xff\xff\xff", b"\x0a\x03\xff\xfe\xfd", b"\x0a\x80"):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await validate(data, metadata=AUTH)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, data
        assert "Validate request is not a valid protobuf message" in (info.value.details() or "")
        assert _trailers(info.value)["error-code"] == "invalid_request"
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await validate(b"\xff\xff\xff\xff")
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    play = channel.stream_stream(f"/{SANDBOX}/Play", None, None)
    good = sandbox_pb2.PlayRequest(action="a").SerializeToString()

    async def messages() -> AsyncIterator[bytes]:
        yield good
        yield b"\xff\xff\xff"

    seen: list[bytes] = []
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for reply in play(messages(), metadata=AUTH):
            seen.append(reply)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len(seen) == 1  # the stream served its good message, then refused the bad one


async def test_a_refusal_names_its_code_in_the_trailers(channel: grpc.aio.Channel) -> None:
    stub = sandbox_pb2_grpc.SandboxStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Validate(sandbox_pb2.ValidateRequest(code="refuse"), metadata=AUTH)
    trailers = _trailers(info.value)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and trailers["error-code"] == "quota_exceeded"


async def test_a_method_s_role_is_checked_once_the_caller_is_known() -> None:
    """A service that declares roles: a known key below a method's role gets PERMISSION_DENIED (never
    UNAUTHENTICATED), an unknown key UNAUTHENTICATED, and a method missing from the table needs admin."""
    from spade.auth import Principal, Role

    ring = KeyRing({hash_key("r"): Principal("watch", Role.READ), hash_key("a"): Principal("ops", Role.ADMIN)})
    demo = GrpcService(
        SANDBOX,
        lambda server: sandbox_pb2_grpc.add_SandboxServicer_to_server(Demo(), server),
        roles={"Validate": Role.READ},  # Play is not listed: admin
    )
    server = grpc_server([demo], ServerAddress(port=0), service="demo", authenticate=ring.authenticate)
    async with server as running, grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as ch:
        stub = sandbox_pb2_grpc.SandboxStub(ch)
        as_reader = (("authorization", "Bearer r"),)
        reply = await stub.Validate(sandbox_pb2.ValidateRequest(code="x"), metadata=as_reader)
        assert "watch" in reply.env_class

        async def one() -> AsyncIterator[sandbox_pb2.PlayRequest]:
            yield sandbox_pb2.PlayRequest(action="a")

        with pytest.raises(grpc.aio.AioRpcError) as denied:
            async for _ in stub.Play(one(), metadata=as_reader):
                pass
        assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "'watch' has the read role" in (denied.value.details() or "")
        seen = [r.state.observation async for r in stub.Play(one(), metadata=(("authorization", "Bearer a"),))]
        assert len(seen) == 1
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await stub.Validate(sandbox_pb2.ValidateRequest(code="x"), metadata=(("authorization", "Bearer x"),))
        assert unknown.value.code() == grpc.StatusCode.UNAUTHENTICATED
