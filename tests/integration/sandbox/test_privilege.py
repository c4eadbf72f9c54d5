"""Least privilege on the real sandbox service, attacked over REST and gRPC (issue 20).

- another tenant's session id is answered exactly like an unknown one (status, code, message), so an
  id tells a caller nothing about anyone else's sessions;
- a ``read`` key (a monitoring system's) runs nothing: 403 / PERMISSION_DENIED, never 401;
- unauthenticated ``/healthz`` is the bare word ``ok``; the details (cgroups, pids, versions) and
  ``/metrics`` (which name tenants) need a key.
"""

from __future__ import annotations

import grpc
import httpx
import pytest

from spade.v1 import sandbox_pb2, sandbox_pb2_grpc
from tests.integration.sandbox.conftest import ALICE_KEY, BOB_KEY, COUNTER_ENV, WATCH_KEY

ALICE = {"Authorization": f"Bearer {ALICE_KEY}"}
BOB = {"Authorization": f"Bearer {BOB_KEY}"}
WATCH = {"Authorization": f"Bearer {WATCH_KEY}"}


def test_a_foreign_session_id_is_answered_like_an_unknown_one_over_rest(http: httpx.Client) -> None:
    sid = http.post("/v1/sessions", json={"code": COUNTER_ENV, "seed": 1}, headers=ALICE).json()["session_id"]
    try:
        foreign_step = http.post(f"/v1/sessions/{sid}/step", json={"action": "go"}, headers=BOB)
        foreign_close = http.delete(f"/v1/sessions/{sid}", headers=BOB)
        # Bob's attempts did not touch Alice's session: she still plays it.
        assert http.post(f"/v1/sessions/{sid}/step", json={"action": "go"}, headers=ALICE).status_code == 200
    finally:
        assert http.delete(f"/v1/sessions/{sid}", headers=ALICE).status_code == 204
    unknown_step = http.post(f"/v1/sessions/{sid}/step", json={"action": "go"}, headers=BOB)
    unknown_close = http.delete(f"/v1/sessions/{sid}", headers=BOB)
    never = "0" * len(sid)
    never_step = http.post(f"/v1/sessions/{never}/step", json={"action": "go"}, headers=BOB)
    for foreign, unknown in ((foreign_step, unknown_step), (foreign_close, unknown_close)):
        assert foreign.status_code == unknown.status_code == 404
        assert foreign.json() == unknown.json()  # byte for byte the same error: nothing to tell them apart
        assert foreign.json()["error"]["code"] == "session_not_found"
    assert never_step.status_code == 404
    assert never_step.json()["error"]["message"] == unknown_step.json()["error"]["message"].replace(sid, never)


def test_a_foreign_session_id_is_answered_like_an_unknown_one_over_grpc(stub: sandbox_pb2_grpc.SandboxStub) -> None:
    alice = (("authorization", f"Bearer {ALICE_KEY}"),)
    bob = (("authorization", f"Bearer {BOB_KEY}"),)
    state = stub.OpenSession(sandbox_pb2.OpenSessionRequest(code=COUNTER_ENV, seed=2), metadata=alice)
    sid = state.session_id

    def refusal(metadata: tuple[tuple[str, str], ...]) -> tuple[grpc.StatusCode, str]:
        with pytest.raises(grpc.RpcError) as info:
            stub.Step(sandbox_pb2.StepRequest(session_id=sid, action="go"), metadata=metadata)
        return info.value.code(), info.value.details() or ""

    try:
        foreign = refusal(bob)
    finally:
        stub.CloseSession(sandbox_pb2.CloseSessionRequest(session_id=sid), metadata=alice)
    unknown = refusal(bob)
    assert foreign == unknown and foreign[0] == grpc.StatusCode.NOT_FOUND


def test_a_read_key_runs_nothing_403_not_401(http: httpx.Client, stub: sandbox_pb2_grpc.SandboxStub) -> None:
    for path, body in (
        ("/v1/execute", {"code": "print(1)"}),
        ("/v1/validate", {"code": COUNTER_ENV}),
        ("/v1/sessions", {"code": COUNTER_ENV, "seed": 1}),
    ):
        response = http.post(path, json=body, headers=WATCH)
        assert response.status_code == 403, (path, response.text)
        error = response.json()["error"]
        assert error["code"] == "forbidden" and "'watch' has the read role" in error["message"], error
    with pytest.raises(grpc.RpcError) as info:
        stub.Execute(sandbox_pb2.ExecuteRequest(code="print(1)"), metadata=(("authorization", f"Bearer {WATCH_KEY}"),))
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    # An unknown key is still 401: the two refusals are told apart.
    assert (
        http.post("/v1/execute", json={"code": "print(1)"}, headers={"Authorization": "Bearer nope"}).status_code == 401
    )


def test_healthz_is_exactly_ok_and_details_and_metrics_need_a_key(http: httpx.Client) -> None:
    health = http.get("/healthz")
    assert (health.status_code, health.text) == (200, "ok")
    for path in ("/healthz/details", "/metrics"):
        refused = http.get(path)
        assert refused.status_code == 401, path
        assert "alice" not in refused.text and "cgroup" not in refused.text
    http.post("/v1/execute", json={"code": "print(1)"}, headers=ALICE)  # a tenant the metrics will name
    details = http.get("/healthz/details", headers=WATCH)  # a read key may look
    assert details.status_code == 200 and details.json()["status"] == "ok" and "sandbox" in details.json()
    metrics = http.get("/metrics", headers=WATCH)
    assert metrics.status_code == 200 and "spade_sandbox_requests" in metrics.text
