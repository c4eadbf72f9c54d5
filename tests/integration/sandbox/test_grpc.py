"""The sandbox's gRPC API end to end over loopback: unary calls, the Play stream, auth, quotas."""

from __future__ import annotations

import json
from collections.abc import Iterator

import grpc
import pytest

from spade.envs import CHECK_NAMES
from spade.envs.examples import EXAMPLES
from spade.v1 import sandbox_pb2, sandbox_pb2_grpc, types_pb2
from tests.integration.sandbox.conftest import ALICE_KEY, BOB_KEY, COUNTER_ENV, MEMORY_BOMB_ENV, Service

ALICE = (("authorization", f"Bearer {ALICE_KEY}"),)
BOB = (("authorization", f"Bearer {BOB_KEY}"),)


def _code(excinfo: pytest.ExceptionInfo[grpc.RpcError]) -> grpc.StatusCode:
    return excinfo.value.code()


def test_validate_reports_every_check(stub: sandbox_pb2_grpc.SandboxStub) -> None:
    tool = next(e for e in EXAMPLES.values() if e.setting == "tool")
    report = stub.Validate(sandbox_pb2.ValidateRequest(code=tool.code, setting=types_pb2.SETTING_TOOL), metadata=ALICE)
    assert [c.name for c in report.checks] == list(CHECK_NAMES)
    assert report.valid and report.env_class


def test_execute(stub: sandbox_pb2_grpc.SandboxStub) -> None:
    result = stub.Execute(
        sandbox_pb2.ExecuteRequest(code="import sys; print(sys.stdin.read()[::-1])", stdin=b"abc"), metadata=ALICE
    )
    assert (result.status, result.exit_code, result.stdout.strip()) == ("ok", 0, b"cba")


def test_unary_session_calls(stub: sandbox_pb2_grpc.SandboxStub) -> None:
    state = stub.OpenSession(
        sandbox_pb2.OpenSessionRequest(code=COUNTER_ENV, setting=types_pb2.SETTING_GAME, seed=3), metadata=ALICE
    )
    assert state.outcome == types_pb2.OUTCOME_OK and isinstance(json.loads(state.info_json), dict)
    step = stub.Step(sandbox_pb2.StepRequest(session_id=state.session_id, action="\\boxed{go}"), metadata=ALICE)
    assert step.observation == "count=1"
    assert stub.CloseSession(sandbox_pb2.CloseSessionRequest(session_id=state.session_id), metadata=ALICE).closed
    with pytest.raises(grpc.RpcError) as excinfo:
        stub.Step(sandbox_pb2.StepRequest(session_id=state.session_id, action="x"), metadata=ALICE)
    assert _code(excinfo) == grpc.StatusCode.NOT_FOUND


def test_play_stream_opens_steps_and_closes(stub: sandbox_pb2_grpc.SandboxStub) -> None:
    first = stub.OpenSession(sandbox_pb2.OpenSessionRequest(code=COUNTER_ENV, seed=9), metadata=ALICE)
    target = int(first.observation.split("exactly ")[1].split(" ")[0])
    stub.CloseSession(sandbox_pb2.CloseSessionRequest(session_id=first.session_id), metadata=ALICE)

    def requests() -> Iterator[sandbox_pb2.PlayRequest]:
        yield sandbox_pb2.PlayRequest(open=sandbox_pb2.OpenSessionRequest(code=COUNTER_ENV, seed=9))
        for _ in range(target):
            yield sandbox_pb2.PlayRequest(action="\\boxed{go}")
        yield sandbox_pb2.PlayRequest(action="\\boxed{stop}")

    states = [r.state for r in stub.Play(requests(), metadata=ALICE)]
    assert len(states) == target + 2
    assert states[-1].terminated and states[-1].reward == 1.0
    assert len({s.session_id for s in states}) == 1
    # The stream's end closed the session.
    with pytest.raises(grpc.RpcError) as excinfo:
        stub.Step(sandbox_pb2.StepRequest(session_id=states[0].session_id, action="x"), metadata=ALICE)
    assert _code(excinfo) == grpc.StatusCode.NOT_FOUND


def test_play_stream_must_open_first(stub: sandbox_pb2_grpc.SandboxStub) -> None:
    with pytest.raises(grpc.RpcError) as excinfo:
        list(stub.Play(iter([sandbox_pb2.PlayRequest(action="go")]), metadata=ALICE))
    assert _code(excinfo) == grpc.StatusCode.INVALID_ARGUMENT


def test_auth_and_bad_input_statuses(stub: sandbox_pb2_grpc.SandboxStub) -> None:
    with pytest.raises(grpc.RpcError) as excinfo:
        stub.Execute(sandbox_pb2.ExecuteRequest(code="print(1)"))
    assert _code(excinfo) == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as excinfo:
        stub.OpenSession(
            sandbox_pb2.OpenSessionRequest(code=COUNTER_ENV, setting=types_pb2.Setting.ValueType(99)), metadata=ALICE
        )
    assert _code(excinfo) == grpc.StatusCode.INVALID_ARGUMENT
    assert "Traceback" not in (excinfo.value.details() or "")
    with pytest.raises(grpc.RpcError) as excinfo:
        stub.Execute(sandbox_pb2.ExecuteRequest(code="x" * (600 * 1024)), metadata=ALICE)
    assert _code(excinfo) == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_another_tenant_cannot_step_a_session(stub: sandbox_pb2_grpc.SandboxStub) -> None:
    state = stub.OpenSession(sandbox_pb2.OpenSessionRequest(code=COUNTER_ENV, seed=2), metadata=ALICE)
    try:
        with pytest.raises(grpc.RpcError) as excinfo:
            stub.Step(sandbox_pb2.StepRequest(session_id=state.session_id, action="go"), metadata=BOB)
        assert _code(excinfo) == grpc.StatusCode.NOT_FOUND  # as if it did not exist: test_privilege.py
    finally:
        stub.CloseSession(sandbox_pb2.CloseSessionRequest(session_id=state.session_id), metadata=ALICE)


def test_play_stream_with_a_bad_key_is_unauthenticated(stub: sandbox_pb2_grpc.SandboxStub) -> None:
    opening = sandbox_pb2.PlayRequest(open=sandbox_pb2.OpenSessionRequest(code=COUNTER_ENV, seed=1))
    with pytest.raises(grpc.RpcError) as excinfo:
        list(stub.Play(iter([opening]), metadata=(("authorization", "Bearer wrong"),)))
    assert _code(excinfo) == grpc.StatusCode.UNAUTHENTICATED


def test_health_service_and_call_metrics(sandbox_service: Service, stub: sandbox_pb2_grpc.SandboxStub) -> None:
    import httpx
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(sandbox_service.grpc_target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        reply = health.Check(health_pb2.HealthCheckRequest(service="spade.v1.Sandbox"))
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError):
        stub.Execute(sandbox_pb2.ExecuteRequest(code="pass"))  # no key
    metrics = httpx.get(f"{sandbox_service.http_url}/metrics", headers={"Authorization": f"Bearer {ALICE_KEY}"}).text
    assert 'spade_sandbox_grpc_requests_total{code="UNAUTHENTICATED",method="Execute"}' in metrics


def test_a_memory_bomb_is_reported_as_a_memory_limit_on_the_play_stream(stub: sandbox_pb2_grpc.SandboxStub) -> None:
    def requests() -> Iterator[sandbox_pb2.PlayRequest]:
        yield sandbox_pb2.PlayRequest(open=sandbox_pb2.OpenSessionRequest(code=MEMORY_BOMB_ENV, seed=1))
        yield sandbox_pb2.PlayRequest(action="\\boxed{bomb}")

    states = [response.state for response in stub.Play(requests(), metadata=ALICE)]
    assert [s.outcome for s in states] == [types_pb2.OUTCOME_OK, types_pb2.OUTCOME_MEMORY_LIMIT]
