"""gRPC over loopback (port 0): MemoryClient against the real server, with keys, on both databases."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest
from sqlalchemy import Engine

from services.memory.core.policy import PolicyConfig
from services.memory.grpc_server import grpc_service
from services.memory.service import MemoryService
from services.memory.settings import MemorySettings
from services.memory.store.sql import SqlStore, migrate
from spade.auth import Unauthenticated, hash_key
from spade.envs.types import FinishReason, Setting
from spade.memory.client import MemoryClient
from spade.memory.errors import EnvironmentNotFound, InvalidArgument, RunSpecConflict, RunSpecNotSet
from spade.memory.records import DesignerAttempt, EnvFilter, EnvProbe, EnvStatus, NewEnvironment, Play, StatsUpdate
from spade.runspec import RunSpec
from spade.serving.grpc import grpc_server
from spade.serving.settings import ServerAddress
from spade.v1 import memory_pb2 as pb
from tests.integration.memory.conftest import env_code, new_env

KEY = "memory-test-key"
ADMIN_KEY = "memory-test-admin-key"
KEYRING = MemorySettings(
    api_keys=[
        {"tenant": "rollout", "key_sha256": hash_key(KEY)},  # no role given: write
        {"tenant": "ops", "key_sha256": hash_key(ADMIN_KEY), "role": "admin"},
    ]
).keyring()


@pytest.fixture
async def served(empty_engine: Engine) -> AsyncIterator[int]:
    """The memory's gRPC API on a free port, keys required as in production; yields the port."""
    migrate(empty_engine)
    service = MemoryService(SqlStore(empty_engine), PolicyConfig(pool_min=2, pool_factor=1))
    async with grpc_server(
        [grpc_service(service)], ServerAddress(port=0), service="memory", authenticate=KEYRING.authenticate
    ) as running:
        yield running.port


@pytest.fixture
async def client(served: int) -> AsyncIterator[MemoryClient]:
    c = MemoryClient(f"127.0.0.1:{served}", timeout_s=20, api_key=KEY)
    yield c
    await c.close()


async def scored(client: MemoryClient, name: str, win_rate: float, regret: float, skill: str = "Optimization") -> str:
    """Store an env and record 10 unhinted plays (win_rate) and 10 hinted ones on the same seeds."""
    env_id = (await client.put_environment(new_env(name, skill=skill))).env_id
    wins = round(win_rate * 10)
    hinted_wins = round(min(1.0, win_rate + regret) * 10)
    plays = [Play(env_id, s, False, float(s < wins), 2, 0, f"{env_id}-u{s}") for s in range(10)]
    plays += [Play(env_id, s, True, float(s < hinted_wins), 2, 0, f"{env_id}-h{s}") for s in range(10)]
    await client.record_plays(plays)
    return env_id


async def test_environment_lifecycle_over_grpc(client: MemoryClient) -> None:
    report = {"valid": True, "checks": [{"name": "smoke", "passed": True, "detail": ""}]}
    put = await client.put_environment(new_env("Wire", validation_report=report, parent_ids=("a", "b")))
    assert not put.duplicate
    dup = await client.put_environment(
        NewEnvironment(setting=Setting.GAME, skill="s", code="# comment\n" + env_code("Wire"))
    )
    assert dup.duplicate_of == put.env_id
    env = await client.get_environment(put.env_id)
    assert env.validation_report == report and env.parent_ids == ("a", "b") and env.stats.win_rate is None

    res = await client.record_plays(
        [Play(put.env_id, 1, False, 1.0, 4, 0, "t1"), Play(put.env_id, 1, True, 1.0, 4, 0, "t2")]
    )
    assert (res.recorded, res.duplicates) == (2, 0)
    assert (await client.record_plays([Play(put.env_id, 1, False, 1.0, 4, 0, "t1")])).duplicates == 1
    env = await client.update_stats(put.env_id, StatsUpdate({"blend": 0.25}, learnable=False, status=EnvStatus.RETIRED))
    assert env.status is EnvStatus.RETIRED and env.stats.reward_components["blend"] == 0.25
    assert env.stats.win_rate == 1.0 and env.stats.regret == 0.0 and env.stats.plays == 2


async def test_errors_map_to_domain_errors(client: MemoryClient) -> None:
    with pytest.raises(EnvironmentNotFound, match="ghost"):
        await client.get_environment("ghost")
    with pytest.raises(EnvironmentNotFound):
        await client.record_plays([Play("ghost", 1, False, 1.0, 1, 0, "t")])
    with pytest.raises(InvalidArgument, match="setting"):
        await client.put_environment(NewEnvironment(setting="board", skill="s", code="x = 1"))  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="cursor"):
        await client.list_environments(cursor="%%%")
    with pytest.raises(InvalidArgument, match="n_positive"):
        await client.sample_examples("game", "s", 1000, 0)


async def test_listing_pages_and_filters_over_grpc(client: MemoryClient) -> None:
    ids = [(await client.put_environment(new_env(f"L{i}", skill="Pattern Recognition"))).env_id for i in range(7)]
    await client.put_environment(new_env("Other", skill="Optimization"))
    f = EnvFilter(skill="Pattern Recognition")
    page = await client.list_environments(f, limit=3, include_code=False)
    got = [e.id for e in page.items]
    assert all(e.code == "" for e in page.items)
    while page.next_cursor:
        page = await client.list_environments(f, limit=3, cursor=page.next_cursor)
        got += [e.id for e in page.items]
    assert got == ids[::-1]


async def test_sample_examples_follows_the_policy(client: MemoryClient) -> None:
    best = await scored(client, "Best", 0.5, 0.5)
    good = await scored(client, "Good", 0.3, 0.3)
    await scored(client, "Meh", 0.6, 0.1)
    easy = await scored(client, "Easy", 1.0, 0.0)
    hard = await scored(client, "Hard", 0.0, 0.0)
    await scored(client, "OtherSkill", 0.5, 0.5, skill="Spatial Reasoning")
    await client.put_environment(new_env("Unscored", skill="Optimization"))

    ex = await client.sample_examples("game", "Optimization", 2, 2, seed=7)
    assert [e.env_id for e in ex.positives] == [best, good]  # pool = top 2 by regret (pool_min=2)
    assert ex.positives[0].reason == "learnable: win rate 0.50, regret 0.50"
    assert {e.env_id for e in ex.negatives} == {easy, hard}
    assert all(e.code.startswith("class ") and "def step" in e.code for e in ex.negatives + ex.positives)
    assert ex == await client.sample_examples("game", "Optimization", 2, 2, seed=7)
    assert (await client.sample_examples("tool", "Optimization", 2, 2)).positives == ()


async def test_every_rpc_refuses_a_caller_without_a_valid_key(served: int) -> None:
    """Reads and writes alike: no metadata, a wrong key and a malformed header are all UNAUTHENTICATED."""
    methods = [m.name for m in pb.DESCRIPTOR.services_by_name["Memory"].methods]
    assert {"PutEnvironment", "ListEnvironments", "RecordPlays", "SetWindow", "SetRunSpec"} <= set(methods)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{served}") as channel:
        for name in methods:
            call = channel.unary_unary(
                f"/spade.v1.Memory/{name}", request_serializer=lambda b: b, response_deserializer=lambda b: b
            )
            for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", "Basic abc"),)):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await call(b"", metadata=metadata, timeout=10)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, (name, metadata)
        health = channel.unary_unary(
            "/grpc.health.v1.Health/Check", request_serializer=lambda b: b, response_deserializer=lambda b: b
        )
        assert await health(b"", timeout=10) is not None  # probes stay open
    anonymous = MemoryClient(f"127.0.0.1:{served}", timeout_s=10)
    with pytest.raises(Unauthenticated, match="SPADE_MEMORY_API_KEYS"):
        await anonymous.list_environments()
    await anonymous.close()


async def test_windows_attempts_and_the_run_spec_over_grpc(client: MemoryClient, served: int) -> None:
    env_id = (await client.put_environment(new_env("Windowed"))).env_id
    env = await client.set_window(env_id, 3, 4)
    assert (env.window_start, env.window_versions, env.code) == (3, 4, "")
    assert (await client.set_window(env_id, 5, 8)).window_start == 3
    assert (await client.get_environment(env_id)).window_start == 3
    with pytest.raises(EnvironmentNotFound):
        await client.set_window("ghost", 1, 1)

    plays = [
        Play(env_id, 1, True, 1.0, 2, 7, "h", FinishReason.TERMINATED, window_start=3, window_index=0, spec_id="s1"),
        Play(env_id, 1, False, 0.5, 2, 8, "u", FinishReason.TERMINATED, window_start=3, window_index=0, spec_id="s1"),
        Play(env_id, 2, False, 0.0, 2, 8, "u2", FinishReason.TERMINATED, window_start=3, window_index=1, spec_id="s1"),
    ]
    await client.record_plays(plays)
    stats = (await client.get_environment(env_id)).stats
    assert (stats.regret, stats.win_rate, stats.solved_fraction, stats.regret_note) == (0.5, 0.25, 0.0, "")

    attempt = DesignerAttempt("d1", Setting.GAME, "Optimization", "malformed", batch_id="r1", weight_version=2)
    assert (await client.record_attempts([attempt, attempt])).recorded == 1

    with pytest.raises(RunSpecNotSet):
        await client.get_run_spec()
    operator = MemoryClient(f"127.0.0.1:{served}", timeout_s=20, api_key=ADMIN_KEY)  # setting the spec is admin's
    spec = RunSpec(group_size=8)
    assert (await operator.set_run_spec(spec)).spec_id == spec.spec_id
    assert RunSpec.from_json((await client.get_run_spec()).spec_json) == spec
    with pytest.raises(RunSpecConflict, match="group_size: stored 8, given 16"):
        await operator.set_run_spec(RunSpec())
    assert (await operator.set_run_spec(RunSpec(), replace=True)).spec_id == RunSpec().spec_id
    await operator.close()


async def test_record_probe_over_grpc_refuses_unknown_envs(client: MemoryClient) -> None:
    env_id = (await client.put_environment(new_env("Probed"))).env_id
    probe = EnvProbe(env_id, "The answer is 42. Guess it.", {"target": 2, "limit": 1}, (r"\boxed{42}",))
    await client.record_probe(probe)
    with pytest.raises(EnvironmentNotFound):
        await client.record_probe(EnvProbe("ghost"))


async def test_a_probe_reported_over_grpc_feeds_the_process_metrics(empty_engine: Engine) -> None:
    migrate(empty_engine)
    service = MemoryService(SqlStore(empty_engine))
    async with grpc_server(
        [grpc_service(service)], ServerAddress(port=0), service="memory", authenticate=KEYRING.authenticate
    ) as running:
        client = MemoryClient(f"127.0.0.1:{running.port}", api_key=KEY)
        env_id = (await client.put_environment(new_env("Leaky"))).env_id
        await client.record_probe(EnvProbe(env_id, "The answer is 42. Guess it.", {"target": 2}, (r"\boxed{42}",)))
        await client.close()
    pool = (await service.stats()).pool
    assert (pool.probed, pool.hidden_state_size_mean, pool.hidden_state_bytes_mean, pool.leakage_share) == (
        1,
        1.0,
        2.0,
        1.0,
    )
