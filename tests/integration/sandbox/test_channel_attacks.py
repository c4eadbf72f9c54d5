"""Issue 20's attacks, for real, over REST and gRPC: env code writing on its channel, a program
forging its own status, text no UTF-8 can carry, and bytes that are no protobuf message.

Each attack must end where it belongs: the env's misbehaviour as the session's ``env_error`` (or a
failed check) with the reason, the caller's bad input as a 422 / INVALID_ARGUMENT naming the field,
and never a 5xx, an INTERNAL or a ``SandboxFault``; the service keeps serving afterwards.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import grpc
import httpx
import pytest

from spade.envs import Outcome
from spade.retry import RetryPolicy
from spade.sandbox import SandboxRefused
from spade.sandbox.client import SandboxClient
from spade.v1 import sandbox_pb2, sandbox_pb2_grpc, types_pb2
from tests.integration.sandbox.conftest import ALICE_KEY, COUNTER_ENV, Service

ALICE = {"Authorization": f"Bearer {ALICE_KEY}"}
ALICE_MD = (("authorization", f"Bearer {ALICE_KEY}"),)
FAST = RetryPolicy(attempts=3, initial_s=0.0, max_s=0.0, jitter_s=0.0)


WRITER_ENV = """
import os, struct

def frame(body):
    return struct.pack(">I", len(body)) + body

FRAME = {frame}

class WriterEnv:
    max_turns = 5

    def reset(self, seed=None):
        if {where!r} == "reset":
            os.write(3, FRAME)
        return "ready", {{}}

    def step(self, action):
        if {where!r} == "step":
            os.write(3, FRAME)
        return "done", 1.0, True, False, {{}}

    def solution(self):
        return ["\\\\boxed{{go}}"]
"""
"""An env that writes a frame on its session channel (fd 3) from ``reset`` or ``step``."""


def writer(frame: str, where: str = "reset") -> str:
    """The env writing ``frame``, a Python expression of its bytes (evaluated in the env, which may
    use ``frame(body)`` to add a length header)."""
    return WRITER_ENV.format(frame=frame, where=where)


FRAMES = {
    "op_without_outcome": """frame(b'{"op": "outcome"}')""",
    "outcome_not_an_object": """frame(b'{"op": "outcome", "outcome": 5}')""",
    "nested_200000_deep": """frame(b"[" * 200_000 + b"]" * 200_000)""",
    "not_utf8": """frame(b"\\xff\\xfe\\xfd")""",
    "lone_surrogate_observation": """frame(b'{"op": "outcome", "outcome": {"observation": "\\\\ud800"}}')""",
    "nan_reward": """frame(b'{"op": "outcome", "outcome": {"reward": NaN}}')""",
    "wrong_field_types": """frame(b'{"op": "outcome", "outcome": {"turn": "x", "info": [1, 2]}}')""",
    "header_cut_short": """b"\\x00\\x00\\x00" """,
}


def _refused(response: httpx.Response, status: int, field: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_request" and f"'{field}'" in error["message"], error


def _still_serving(http: httpx.Client) -> None:
    result = http.post("/v1/execute", json={"code": "print(6 * 7)"}, headers=ALICE)
    assert result.status_code == 200 and result.json()["stdout"] == "42\n", result.text


# -- the session channel -------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(FRAMES))
def test_a_frame_env_code_writes_in_reset_ends_the_session_as_env_error_over_rest(
    http: httpx.Client, name: str
) -> None:
    opened = http.post("/v1/sessions", json={"code": writer(FRAMES[name]), "seed": 1}, headers=ALICE)
    assert opened.status_code == 201, opened.text
    body = opened.json()
    assert body["outcome"] == "env_error" and body["truncated"] is True, body
    assert body["observation"] and body["info"]["error"] == body["observation"]  # the reason, said
    step = http.post(f"/v1/sessions/{body['session_id']}/step", json={"action": "\\boxed{go}"}, headers=ALICE)
    assert step.status_code == 409  # the session ended with it
    _still_serving(http)


def test_a_frame_env_code_writes_in_step_ends_the_session_as_env_error_over_rest(http: httpx.Client) -> None:
    opened = http.post("/v1/sessions", json={"code": writer(FRAMES["op_without_outcome"], "step")}, headers=ALICE)
    assert opened.status_code == 201 and opened.json()["outcome"] == "ok", opened.text
    sid = opened.json()["session_id"]
    step = http.post(f"/v1/sessions/{sid}/step", json={"action": "\\boxed{go}"}, headers=ALICE)
    assert step.status_code == 200, step.text
    assert step.json()["outcome"] == "env_error" and "invalid outcome" in step.json()["observation"]


@pytest.mark.parametrize("name", ["op_without_outcome", "outcome_not_an_object", "nested_200000_deep"])
def test_a_frame_env_code_writes_is_env_error_over_grpc(stub: sandbox_pb2_grpc.SandboxStub, name: str) -> None:
    state = stub.OpenSession(sandbox_pb2.OpenSessionRequest(code=writer(FRAMES[name]), seed=1), metadata=ALICE_MD)
    assert state.outcome == types_pb2.OUTCOME_ENV_ERROR and state.truncated and state.observation, state


def _grpc_calls(http: httpx.Client, method: str) -> float:
    """Calls of ``method`` the service has counted so far, whatever their status."""
    total = 0.0
    scraped = http.get("/metrics", headers=ALICE)  # /metrics needs a key
    scraped.raise_for_status()
    for line in scraped.text.splitlines():
        if line.startswith("spade_sandbox_grpc_requests_total{") and f'method="{method}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


async def test_the_client_gets_env_error_once_not_a_retried_sandbox_fault(
    sandbox_service: Service, http: httpx.Client
) -> None:
    before = _grpc_calls(http, "Play")
    async with SandboxClient(sandbox_service.grpc_target, ALICE_KEY, retry=FAST) as client:
        session = await client.open_session(writer(FRAMES["outcome_not_an_object"]), "game", 1)
        await session.close()
    assert session.initial.outcome is Outcome.ENV_ERROR, session.initial
    # A retry would have been a call that ended before open_session returned; the one stream is
    # counted once it ends, which the service sees a moment after the close.
    deadline = time.monotonic() + 30
    while _grpc_calls(http, "Play") - before < 1 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert _grpc_calls(http, "Play") - before == 1  # one try: nothing to retry


# -- validation: env code on its host's channel ----------------------------------------------------


@pytest.mark.parametrize("name", ["op_without_outcome", "nested_200000_deep", "not_utf8"])
def test_env_code_writing_on_its_channel_in_validation_fails_a_check(http: httpx.Client, name: str) -> None:
    response = http.post("/v1/validate", json={"code": writer(FRAMES[name])}, headers=ALICE)
    assert response.status_code == 200, response.text
    report = response.json()
    failed = [c for c in report["checks"] if not c["passed"]]
    assert report["valid"] is False and failed and failed[0]["detail"], report


def test_env_code_writing_on_its_channel_in_validation_over_grpc(stub: sandbox_pb2_grpc.SandboxStub) -> None:
    report = stub.Validate(sandbox_pb2.ValidateRequest(code=writer(FRAMES["not_utf8"])), metadata=ALICE_MD)
    assert not report.valid and any(not c.passed and c.detail for c in report.checks)


# -- one-shot status -------------------------------------------------------------------------------


FORGERIES = {
    "marker_on_fd3": "import os\nos.write(3, b'M')\n",
    "memory_exit_code": "import os\nos._exit(86)\n",
    # Stopping itself as the runtime does at its limit, but far under it: pid 1 measures, continues it.
    "stop_under_the_limit": "import os, signal\nos.kill(os.getpid(), signal.SIGSTOP)\nraise SystemExit(1)\n",
    "every_fd": "import os\nfor fd in range(3, 64):\n    try:\n        os.write(fd, b'M')\n"
    "    except OSError:\n        pass\n",
}


@pytest.mark.parametrize("name", sorted(FORGERIES))
def test_a_program_cannot_write_its_own_status_over_rest(http: httpx.Client, name: str) -> None:
    result = http.post("/v1/execute", json={"code": FORGERIES[name]}, headers=ALICE).json()
    assert result["status"] in ("ok", "error") and result["status"] != "memory_limit", result


def test_a_program_holds_only_its_stdio(http: httpx.Client) -> None:
    code = "import os\nprint(sorted(int(fd) for fd in os.listdir('/proc/self/fd')))\n"
    result = http.post("/v1/execute", json={"code": code}, headers=ALICE).json()
    # 0-2 and the descriptor listdir itself opened: no channel to pid 1.
    assert json.loads(result["stdout"]) == [0, 1, 2, 3], result


def test_a_program_cannot_write_its_own_status_over_grpc(stub: sandbox_pb2_grpc.SandboxStub) -> None:
    result = stub.Execute(sandbox_pb2.ExecuteRequest(code=FORGERIES["marker_on_fd3"]), metadata=ALICE_MD)
    assert (result.status, result.exit_code) == ("error", 1), result


@pytest.mark.parametrize(
    "code", ["blocks = []\nwhile True:\n    blocks.append(bytearray(16 << 20))\n", "x = bytearray(10**12)\n"]
)
def test_a_real_memory_bomb_is_still_a_memory_limit(http: httpx.Client, code: str) -> None:
    result = http.post("/v1/execute", json={"code": code, "memory_mb": 128}, headers=ALICE).json()
    assert (result["status"], result["exit_code"]) == ("memory_limit", 1) and "MemoryError" in result["stderr"]


# -- caller input refused at the door ------------------------------------------------------------


LONE = '"\\ud800"'  # the JSON escape of a lone surrogate: valid JSON, no UTF-8 text


def _raw(http: httpx.Client, path: str, body: str) -> httpx.Response:
    return http.post(path, content=body.encode(), headers={**ALICE, "Content-Type": "application/json"})


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (f'{{"code": "print(1)", "stdin": {LONE}}}', "stdin"),
        (f'{{"code": "print(1)", "files": {{"a.txt": {LONE}}}}}', "files[a.txt]"),
        (f'{{"code": "print(1)", "files": {{{LONE}: "x"}}}}', "files path"),
        (f'{{"code": {LONE}}}', "code"),
    ],
)
def test_unencodable_text_in_an_execution_is_a_422_naming_the_field(http: httpx.Client, body: str, field: str) -> None:
    _refused(_raw(http, "/v1/execute", body), 422, field)


def test_unencodable_code_in_validate_and_open_is_a_422(http: httpx.Client) -> None:
    _refused(_raw(http, "/v1/validate", f'{{"code": {LONE}}}'), 422, "code")
    _refused(_raw(http, "/v1/sessions", f'{{"code": {LONE}}}'), 422, "code")


def test_an_unencodable_action_is_refused_and_the_session_lives_on(http: httpx.Client) -> None:
    opened = http.post("/v1/sessions", json={"code": COUNTER_ENV, "seed": 5}, headers=ALICE).json()
    sid = opened["session_id"]
    try:
        _refused(_raw(http, f"/v1/sessions/{sid}/step", f'{{"action": {LONE}}}'), 422, "action")
        step = http.post(f"/v1/sessions/{sid}/step", json={"action": "\\boxed{go}"}, headers=ALICE)
        assert step.status_code == 200 and step.json()["outcome"] == "ok", step.text  # not blamed on the env
    finally:
        http.delete(f"/v1/sessions/{sid}", headers=ALICE)


@pytest.mark.parametrize(
    ("method", "data"),
    [
        ("Execute", b"\xff\xff\xff\xff"),  # no field can start so
        ("Execute", b"\x0a\x03\xff\xfe\xfd"),  # field 1 (code): 3 bytes that are not UTF-8
        ("OpenSession", b"\x0a\x80"),  # a length cut short
        ("Validate", b"\x12\x02\xc3"),  # setting: a truncated length-delimited field
    ],
)
def test_malformed_protobuf_is_invalid_argument(sandbox_service: Service, method: str, data: bytes) -> None:
    with grpc.insecure_channel(sandbox_service.grpc_target) as channel:
        call = channel.unary_unary(f"/spade.v1.Sandbox/{method}", None, None)
        with pytest.raises(grpc.RpcError) as refused:
            call(data, metadata=ALICE_MD)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value
    assert "not a valid protobuf message" in (refused.value.details() or "")


def test_malformed_protobuf_on_the_play_stream_is_invalid_argument(sandbox_service: Service) -> None:
    with grpc.insecure_channel(sandbox_service.grpc_target) as channel:
        play = channel.stream_stream("/spade.v1.Sandbox/Play", None, None)
        with pytest.raises(grpc.RpcError) as refused:
            list(play(iter([b"\xff\xff\xff"]), metadata=ALICE_MD))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value


def test_malformed_protobuf_without_a_key_is_still_unauthenticated(sandbox_service: Service) -> None:
    with grpc.insecure_channel(sandbox_service.grpc_target) as channel:
        call = channel.unary_unary("/spade.v1.Sandbox/Execute", None, None)
        with pytest.raises(grpc.RpcError) as refused:
            call(b"\xff\xff\xff\xff")
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_surrogate_in_a_grpc_action_is_refused_and_the_session_lives_on(
    sandbox_service: Service, stub: sandbox_pb2_grpc.SandboxStub
) -> None:
    state = stub.OpenSession(sandbox_pb2.OpenSessionRequest(code=COUNTER_ENV, seed=5), metadata=ALICE_MD)
    sid = state.session_id.encode()
    # StepRequest{session_id, action}: the action is a UTF-8-encoded surrogate, which no UTF-8 text holds.
    data = b"\x0a" + bytes([len(sid)]) + sid + b"\x12\x03\xed\xa0\x80"
    with grpc.insecure_channel(sandbox_service.grpc_target) as channel, pytest.raises(grpc.RpcError) as refused:
        channel.unary_unary("/spade.v1.Sandbox/Step", None, None)(data, metadata=ALICE_MD)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value
    step = stub.Step(sandbox_pb2.StepRequest(session_id=state.session_id, action="\\boxed{go}"), metadata=ALICE_MD)
    assert step.outcome == types_pb2.OUTCOME_OK and step.observation == "count=1"  # not blamed on the env
    stub.CloseSession(sandbox_pb2.CloseSessionRequest(session_id=state.session_id), metadata=ALICE_MD)


# -- refusals that share RESOURCE_EXHAUSTED ----------------------------------------------------------


def _trailers(error: grpc.RpcError) -> dict[str, str]:
    pairs: Any = error.trailing_metadata() or ()
    return {str(key): str(value) for key, value in pairs}


def test_too_large_and_quota_refusals_are_told_apart_by_their_trailers(stub: sandbox_pb2_grpc.SandboxStub) -> None:
    with pytest.raises(grpc.RpcError) as too_large:
        stub.Execute(sandbox_pb2.ExecuteRequest(code="x" * (300 * 1024)), metadata=ALICE_MD)
    assert too_large.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    trailers = _trailers(too_large.value)
    assert trailers["error-code"] == "payload_too_large" and "retry-after" not in trailers

    opened = [
        stub.OpenSession(sandbox_pb2.OpenSessionRequest(code=COUNTER_ENV, seed=seed), metadata=ALICE_MD)
        for seed in (1, 2)  # alice's max_sessions
    ]
    try:
        with pytest.raises(grpc.RpcError) as quota:
            stub.OpenSession(sandbox_pb2.OpenSessionRequest(code=COUNTER_ENV, seed=3), metadata=ALICE_MD)
    finally:
        for state in opened:
            stub.CloseSession(sandbox_pb2.CloseSessionRequest(session_id=state.session_id), metadata=ALICE_MD)
    assert quota.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    trailers = _trailers(quota.value)
    assert trailers["error-code"] == "quota_exceeded" and int(trailers["retry-after"]) >= 1


async def test_the_client_refuses_a_too_large_request_at_once(sandbox_service: Service, http: httpx.Client) -> None:
    before = _grpc_calls(http, "Execute")
    async with SandboxClient(sandbox_service.grpc_target, ALICE_KEY, retry=FAST) as client:
        with pytest.raises(SandboxRefused, match="payload_too_large"):
            await client.execute("x" * (300 * 1024))
    deadline = time.monotonic() + 30
    while _grpc_calls(http, "Execute") - before < 1 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert _grpc_calls(http, "Execute") - before == 1  # not retried: the same request cannot pass
