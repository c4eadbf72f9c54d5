"""Rollout worker processes killed mid-play (SIGKILL) or stopped (SIGTERM), on real Redis, Postgres and sandbox.

Leases follow liveness: a worker restarted under its own name resumes its slot at once, although its
lease is still valid; under a new name the slot is taken over once the dead worker's lease expires;
a worker told to stop hands its lease back at once and keeps its finished plays. In every case each
play is published and recorded exactly once and no window slot is skipped without a record.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import sqlalchemy as sa

from services.memory.service import MemoryService
from services.memory.store.sql import SqlStore, make_engine, migrate
from services.rollout.state_store import RolloutStateStore
from spade.envs.types import Setting
from spade.memory.records import EnvStatus, NewEnvironment
from spade.queues.base import ENVS_READY, SAMPLES_AGENT, WEIGHTS_PUBLISHED
from spade.queues.config import RedisQueueConfig
from spade.queues.messages import decode, publish_proto
from spade.queues.redis_streams import RedisStreamQueue
from spade.runspec import RunSpec
from spade.v1 import queues_pb2, types_pb2
from tests.conftest import POSTGRES_URL, REDIS_URL
from tests.unit.rollout.envs import CountdownEnv

pytestmark = [
    pytest.mark.slow,
    pytest.mark.db,
    pytest.mark.redis,
    pytest.mark.model,
    pytest.mark.sandbox,
    pytest.mark.timeout(900),
]  # a real model or processes on a shared CPU

G = 2
K = 2
SPEC = RunSpec(group_size=G, window_versions_game=K, agent_max_turns=2, agent_max_tokens_per_turn=32)
CODE = inspect.getsource(CountdownEnv)
ROOT = Path(__file__).resolve().parents[3]
HANG_AT = 2 * 2 + 1
"""The model call the first worker hangs on: two plays of two turns are finished by then (one play at a time)."""


@pytest.fixture
def database_url() -> Iterator[str]:
    """A Postgres schema of its own, holding the memory and the rollout's state (as in a deployment)."""
    schema = f"rollout_kill_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    sep = "&" if "?" in POSTGRES_URL else "?"
    try:
        yield f"{POSTGRES_URL}{sep}options=-csearch_path%3D{schema}"
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


@dataclass
class Cluster:
    url: str
    tmp: Path
    memory: MemoryService
    queue: RedisStreamQueue
    store: RolloutStateStore
    prefix: str
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(self, name: str, *, hang_at: int = 0, lease_s: float = 300.0, grace_s: float = 5.0) -> Path:
        """Start a worker process; returns the file it writes when it hangs mid-play."""
        ready = self.tmp / f"{name}-{len(self.procs)}.ready"
        args = {
            "spec": SPEC.to_json(),
            "redis_url": REDIS_URL,
            "prefix": self.prefix,
            "memory_url": self.url,
            "state_url": self.url,
            "name": name,
            "hang_at": hang_at,
            "lease_s": lease_s,
            "grace_s": grace_s,
            "ready_file": str(ready),
        }
        cmd = [sys.executable, "-m", "tests.integration.rollout.worker_process", json.dumps(args)]
        self.procs.append(subprocess.Popen(cmd, cwd=ROOT))
        return ready

    async def until(self, what: str, check: Callable[[], object], timeout_s: float = 240.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            got = check()
            if asyncio.iscoroutine(got):
                got = await got
            if got:
                return
            for proc in self.procs:
                assert proc.poll() in (None, -signal.SIGKILL, 0), f"a worker process failed: {proc.returncode}"
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            await asyncio.sleep(0.1)

    async def put_env(self) -> str:
        put = await self.memory.put_environment(
            NewEnvironment(setting=Setting.GAME, skill="Optimization", code=CODE, hint="Read it.", weight_version=0)
        )
        ready = queues_pb2.EnvReady(
            env_id=put.env_id, setting=types_pb2.SETTING_GAME, weight_version=0, spec_id=SPEC.spec_id
        )
        await publish_proto(self.queue, ENVS_READY, ready, key=put.env_id)
        return put.env_id

    async def publish_weights(self, version: int) -> None:
        msg = queues_pb2.WeightsPublished(weight_version=version, spec_id=SPEC.spec_id)
        await publish_proto(self.queue, WEIGHTS_PUBLISHED, msg, key=f"w{version}")

    async def plays(self, env_id: str, slot: int | None = None) -> int:
        plays, _ = await self.memory.plays(env_id)
        ids = [p.trajectory_id for p in plays if slot is None or p.window_index == slot]
        assert len(ids) == len(set(ids))
        return len(ids)

    async def samples(self) -> list[queues_pb2.AgentSample]:
        """Every message on samples.agent (an audit group reads the stream from its start)."""
        out: list[queues_pb2.AgentSample] = []
        while got := await self.queue.consume(SAMPLES_AGENT, "audit", "auditor", count=100, block_ms=50):
            for d in got:
                msg = decode(d)
                assert isinstance(msg, queues_pb2.AgentSample)
                out.append(msg)
        return out

    def kill(self, index: int, sig: signal.Signals = signal.SIGKILL) -> None:
        os.kill(self.procs[index].pid, sig)


@pytest.fixture
async def cluster(database_url: str, tmp_path: Path) -> AsyncIterator[Cluster]:
    engine = make_engine(database_url)
    migrate(engine)
    prefix = f"test-rollout-kill-{uuid.uuid4().hex[:8]}:"
    queue = RedisStreamQueue(RedisQueueConfig(url=REDIS_URL, prefix=prefix))
    store = RolloutStateStore.from_url(database_url)
    c = Cluster(database_url, tmp_path, MemoryService(SqlStore(engine)), queue, store, prefix)
    try:
        yield c
    finally:
        for proc in c.procs:
            if proc.poll() is None:
                proc.terminate()  # graceful: the worker stops its sandbox pool
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)
        store.dispose()
        await queue.delete_all()
        await queue.close()
        engine.dispose()


async def _finish_the_window(c: Cluster, env_id: str) -> None:
    """Publish the window's next version and wait until the env retires; then audit everything."""
    await c.publish_weights(1)

    async def retired() -> bool:
        return (await c.memory.get_environment(env_id)).status is EnvStatus.RETIRED

    await c.until("the window to close", retired)
    samples = await c.samples()
    ids = [s.sample_id for s in samples]
    assert len(ids) == len(set(ids)) == 2 * G + G  # each play sent exactly once
    assert await c.plays(env_id) == 2 * G + G  # and recorded exactly once
    assert {(s.window_index, s.hinted) for s in samples} == {(0, False), (0, True), (1, False)}
    assert await c.store.skipped(env_id) == []  # no slot skipped, so none without a record


async def _hang_then(c: Cluster, name: str, sig: signal.Signals, **options: float) -> str:
    env_id = await c.put_env()
    ready = c.start(name, hang_at=HANG_AT, **options)
    await c.until("the first worker to hang mid-play", ready.exists)
    c.kill(0, sig)
    return env_id


async def test_a_worker_killed_mid_play_and_restarted_under_its_name_resumes_at_once(cluster: Cluster) -> None:
    env_id = await _hang_then(cluster, "rollout-a", signal.SIGKILL, lease_s=300.0)
    cluster.procs[0].wait(30)
    owner, until = await cluster.store.lease(env_id)
    assert owner == "rollout-a" and until is not None  # SIGKILL: the lease is still the dead worker's

    cluster.start("rollout-a", lease_s=300.0)  # the same stable name (a pod name, a configured name)

    async def slot_done() -> bool:
        return await cluster.plays(env_id, slot=0) == 2 * G

    await cluster.until("the restarted worker to finish the slot", slot_done)
    # It did not wait for its old lease (valid for 300 s) to run out: it took its own work back.
    assert time.time() < until
    await _finish_the_window(cluster, env_id)


async def test_a_worker_killed_mid_play_is_taken_over_by_a_new_name_within_one_lease(cluster: Cluster) -> None:
    env_id = await _hang_then(cluster, "rollout-old", signal.SIGKILL, lease_s=4.0)
    cluster.procs[0].wait(30)
    cluster.start("rollout-new", lease_s=4.0)

    async def taken_over() -> bool:
        return (await cluster.store.lease(env_id))[0] == "rollout-new" or await cluster.plays(env_id, 0) == 2 * G

    await cluster.until("another worker to take the slot over", taken_over)
    await _finish_the_window(cluster, env_id)


async def test_sigterm_mid_play_exits_within_its_grace_keeps_finished_plays_and_hands_the_lease_over(
    cluster: Cluster,
) -> None:
    env_id = await _hang_then(cluster, "rollout-t", signal.SIGTERM, lease_s=300.0, grace_s=1.0)
    assert cluster.procs[0].wait(60) == 0  # grace 1 s, then the hanging play is cancelled and it exits
    assert await cluster.store.lease(env_id) == (None, None)  # handed back, not left to expire
    kept = await cluster.store.done_plays(env_id, 0)
    assert len(kept) >= 2 and await cluster.plays(env_id, 0) == len(kept)
    cluster.start("rollout-u", lease_s=300.0)  # a new name: the lease is free, so no 300 s wait

    async def slot_done() -> bool:
        return await cluster.plays(env_id, slot=0) == 2 * G

    await cluster.until("the next worker to finish the slot", slot_done)
    await _finish_the_window(cluster, env_id)
