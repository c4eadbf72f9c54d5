"""Memory keys have roles (issue 20), attacked for real over gRPC and REST on both databases.

The key handed out for the web page (``read``) looks and nothing else: it cannot store environments or
plays, nor set or replace the run spec (403 / ``PERMISSION_DENIED``, never 401); a service's key
(``write``, the default for a key naming no role) stores but cannot touch the run spec; only
``admin`` sets it. Unauthenticated ``/healthz`` is the bare word ``ok``; ``/metrics`` and the details
need a key.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import httpx
import pytest
from sqlalchemy import Engine

from services.memory.grpc_server import METHOD_ROLES, grpc_service
from services.memory.rest import COOKIE, create_app
from services.memory.service import MemoryService
from services.memory.settings import MemorySettings
from services.memory.store.sql import SqlStore, migrate
from spade.auth import Forbidden, Role, hash_key
from spade.memory.client import MemoryClient
from spade.memory.records import Play, StatsUpdate
from spade.runspec import RunSpec
from spade.serving.grpc import grpc_server
from spade.serving.settings import ServerAddress
from spade.v1 import memory_pb2 as pb
from tests.integration.memory.conftest import new_env

READ_KEY, WRITE_KEY, ADMIN_KEY = "web-page-key", "rollout-key", "operator-key"
SETTINGS = MemorySettings(
    api_keys=[
        {"tenant": "web", "key_sha256": hash_key(READ_KEY), "role": "read"},
        {"tenant": "rollout", "key_sha256": hash_key(WRITE_KEY)},  # no role: write
        {"tenant": "operator", "key_sha256": hash_key(ADMIN_KEY), "role": "admin"},
    ]
)


@pytest.fixture
def service(empty_engine: Engine) -> MemoryService:
    migrate(empty_engine)
    return MemoryService(SqlStore(empty_engine))


@pytest.fixture
async def clients(service: MemoryService) -> AsyncIterator[dict[str, MemoryClient]]:
    """A client per role against the real gRPC server, keys checked as in production."""
    async with grpc_server(
        [grpc_service(service)], ServerAddress(port=0), service="memory", authenticate=SETTINGS.keyring().authenticate
    ) as running:
        made = {
            role: MemoryClient(f"127.0.0.1:{running.port}", timeout_s=20, api_key=key)
            for role, key in (("read", READ_KEY), ("write", WRITE_KEY), ("admin", ADMIN_KEY))
        }
        yield made
        for client in made.values():
            await client.close()


@pytest.fixture
async def http(service: MemoryService) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(service, SETTINGS)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://memory") as c:
        yield c


def test_every_memory_method_has_a_role() -> None:
    methods = set(pb.DESCRIPTOR.services_by_name["Memory"].methods_by_name)
    assert set(METHOD_ROLES) == methods
    assert METHOD_ROLES["SetRunSpec"] is Role.ADMIN
    assert {m for m, r in METHOD_ROLES.items() if r is Role.READ} == {
        "GetEnvironment",
        "ListEnvironments",
        "SampleExamples",
        "GetRunSpec",
    }


async def test_a_read_key_cannot_write_or_replace_the_run_spec_over_grpc(clients: dict[str, MemoryClient]) -> None:
    reader, writer, admin = clients["read"], clients["write"], clients["admin"]
    await admin.set_run_spec(RunSpec(group_size=8))
    env_id = (await writer.put_environment(new_env("Stored"))).env_id
    # The read key looks...
    assert (await reader.get_environment(env_id)).id == env_id
    assert [e.id for e in (await reader.list_environments()).items] == [env_id]
    assert RunSpec.from_json((await reader.get_run_spec()).spec_json).group_size == 8
    # ...and can change nothing: each refusal is 403 (PERMISSION_DENIED), naming the role it lacks.
    attempts: dict[str, Callable[[], Awaitable[object]]] = {
        "put_environment": lambda: reader.put_environment(new_env("Intruder")),
        "record_plays": lambda: reader.record_plays([Play(env_id, 1, False, 1.0, 2, 0, "forged")]),
        "update_stats": lambda: reader.update_stats(env_id, StatsUpdate(learnable=True)),
        "set_window": lambda: reader.set_window(env_id, 1, 2),
        "set_run_spec": lambda: reader.set_run_spec(RunSpec(), replace=False),
        "replace_run_spec": lambda: reader.set_run_spec(RunSpec(group_size=2), replace=True),
    }
    for name, attempt in attempts.items():
        try:
            await attempt()
        except Forbidden as refused:
            assert "'web' has the read role" in str(refused), (name, refused)
        else:
            pytest.fail(f"{name} got through with a read key")
    assert (await reader.get_environment(env_id)).stats.plays == 0  # nothing got through
    assert RunSpec.from_json((await reader.get_run_spec()).spec_json).group_size == 8


async def test_a_service_key_writes_but_only_admin_replaces_the_run_spec(clients: dict[str, MemoryClient]) -> None:
    writer, admin = clients["write"], clients["admin"]
    env_id = (await writer.put_environment(new_env("Played"))).env_id
    assert (await writer.record_plays([Play(env_id, 1, False, 1.0, 2, 0, "p1")])).recorded == 1
    with pytest.raises(Forbidden, match=r"'rollout' has the write role; spade\.v1\.Memory/SetRunSpec needs admin"):
        await writer.set_run_spec(RunSpec(group_size=2), replace=True)
    with pytest.raises(Forbidden):
        await writer.set_run_spec(RunSpec())
    assert (await admin.set_run_spec(RunSpec(group_size=4))).spec_id == RunSpec(group_size=4).spec_id
    assert (await admin.set_run_spec(RunSpec(group_size=2), replace=True)).spec_id == RunSpec(group_size=2).spec_id


async def test_the_raw_status_is_permission_denied_not_unauthenticated(service: MemoryService) -> None:
    async with (
        grpc_server(
            [grpc_service(service)],
            ServerAddress(port=0),
            service="memory",
            authenticate=SETTINGS.keyring().authenticate,
        ) as running,
        grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel,
    ):
        call = channel.unary_unary(
            "/spade.v1.Memory/SetRunSpec",
            request_serializer=pb.SetRunSpecRequest.SerializeToString,
            response_deserializer=pb.RunSpecRecord.FromString,
        )
        request = pb.SetRunSpecRequest(spec_json=RunSpec().to_json(), replace=True)
        for key, status in (
            (READ_KEY, grpc.StatusCode.PERMISSION_DENIED),
            (WRITE_KEY, grpc.StatusCode.PERMISSION_DENIED),
            ("not-a-key", grpc.StatusCode.UNAUTHENTICATED),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call(request, metadata=(("authorization", f"Bearer {key}"),), timeout=10)
            assert info.value.code() == status, key


async def test_the_rest_api_and_page_need_only_read_and_offer_no_way_to_write(http: httpx.AsyncClient) -> None:
    read = {"Authorization": f"Bearer {READ_KEY}"}
    assert (await http.get("/v1/environments", headers=read)).status_code == 200
    assert (await http.get("/v1/runspec", headers=read)).status_code == 404  # none set yet; read may ask
    # Nothing over REST writes: every API route is a GET, and writing verbs on them are refused.
    schema = (await http.get("/openapi.json")).json()
    verbs = {verb for item in schema["paths"].values() for verb in item}
    assert verbs == {"get"}, verbs
    for method, path in (("PUT", "/v1/runspec"), ("POST", "/v1/runspec"), ("POST", "/v1/environments")):
        for key in (READ_KEY, ADMIN_KEY):
            response = await http.request(method, path, headers={"Authorization": f"Bearer {key}"}, json={})
            assert response.status_code == 405, (method, path)
    # The web page logs in with the read key and its session reads.
    login = await http.post("/login", data={"token": READ_KEY})
    assert login.status_code == 303 and login.cookies[COOKIE]
    assert (await http.get("/v1/stats")).status_code == 200
    assert (await http.get("/")).status_code == 200


async def test_healthz_is_exactly_ok_and_metrics_need_a_key(http: httpx.AsyncClient) -> None:
    health = await http.get("/healthz")
    assert (health.status_code, health.text) == (200, "ok")
    for path in ("/metrics", "/healthz/details"):
        refused = await http.get(path)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "unauthenticated", path
    read = {"Authorization": f"Bearer {READ_KEY}"}
    assert "spade_memory_plays" in (await http.get("/metrics", headers=read)).text
    assert (await http.get("/healthz/details", headers=read)).json() == {"status": "ok"}
