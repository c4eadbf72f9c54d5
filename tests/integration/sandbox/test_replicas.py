"""Two real sandbox servers on one Redis: a tenant's quotas hold across both, and 429s say when to retry."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import grpc
import httpx
import pytest

from services.sandbox.core.auth import hash_key
from services.sandbox.settings import SandboxSettings
from spade.v1 import sandbox_pb2, sandbox_pb2_grpc
from tests.conftest import needs
from tests.integration.sandbox.conftest import COUNTER_ENV, Service, running_service

KEY = "carol-" + uuid.uuid4().hex
CAROL = {"Authorization": f"Bearer {KEY}"}
GRPC_CAROL = (("authorization", f"Bearer {KEY}"),)


def replica_settings(prefix: str) -> SandboxSettings:
    return SandboxSettings(
        grpc={"host": "127.0.0.1", "port": 0},
        http={"host": "127.0.0.1", "port": 0},
        api_keys=[{"tenant": "carol", "key_sha256": hash_key(KEY), "max_sessions": 1, "executions_per_minute": 4}],
        quotas={"kind": "redis", "url": "redis://127.0.0.1:6379/0", "prefix": prefix},
        isolation={"zygotes": 1, "spares": 1},
    )


@pytest.fixture(scope="module")
@needs("sandbox", "redis")
def replicas() -> Iterator[tuple[Service, Service]]:
    prefix = f"spade-test:replicas:{uuid.uuid4().hex}"
    with running_service(replica_settings(prefix)) as first, running_service(replica_settings(prefix)) as second:
        yield first, second


def client(service: Service) -> httpx.Client:
    return httpx.Client(base_url=service.http_url, timeout=60, headers=CAROL)


def test_a_tenant_over_its_shared_quota_is_refused_by_either_replica(replicas: tuple[Service, Service]) -> None:
    with client(replicas[0]) as a, client(replicas[1]) as b:
        # One session between both replicas; opening it is also one of the 4 runs a minute.
        opened = a.post("/v1/sessions", json={"code": COUNTER_ENV, "seed": 2})
        assert opened.status_code == 201, opened.text
        refused = b.post("/v1/sessions", json={"code": COUNTER_ENV, "seed": 2})
        assert refused.status_code == 429 and "limit is 1" in refused.json()["error"]["message"]
        assert int(refused.headers["Retry-After"]) >= 1
        # Play it to the end on its replica: the slot is free at once, on the other replica too.
        session = opened.json()["session_id"]
        target = int(opened.json()["observation"].split("exactly ")[1].split(" ")[0])
        for _ in range(target):
            a.post(f"/v1/sessions/{session}/step", json={"action": "\\boxed{go}"})
        end = a.post(f"/v1/sessions/{session}/step", json={"action": "\\boxed{stop}"}).json()
        assert end["terminated"] and end["reward"] == 1.0
        again = b.post("/v1/sessions", json={"code": COUNTER_ENV, "seed": 3})
        assert again.status_code == 201, again.text
        b.delete(f"/v1/sessions/{again.json()['session_id']}")
        # Runs so far: the two session opens that got a slot (a refused open is not charged).
        assert a.post("/v1/execute", json={"code": "print(1)"}).status_code == 200
        assert b.post("/v1/execute", json={"code": "print(1)"}).status_code == 200
        over = a.post("/v1/execute", json={"code": "print(1)"})  # the 5th run of a 4-a-minute tenant
        assert over.status_code == 429, over.text
        assert "runs (executions, validations and session opens) per minute" in over.json()["error"]["message"]
        assert 1 <= int(over.headers["Retry-After"]) <= 60
        # The same refusal over gRPC, from the other replica: RESOURCE_EXHAUSTED with a retry-after trailer.
        with grpc.insecure_channel(replicas[1].grpc_target) as channel:
            stub = sandbox_pb2_grpc.SandboxStub(channel)
            with pytest.raises(grpc.RpcError) as refused_grpc:
                stub.Execute(sandbox_pb2.ExecuteRequest(code="print(1)"), metadata=GRPC_CAROL)
        assert refused_grpc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        trailers = {item.key: item.value for item in refused_grpc.value.trailing_metadata() or ()}
        assert 1 <= int(trailers["retry-after"]) <= 60
