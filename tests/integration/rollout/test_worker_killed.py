"""A rollout worker process SIGKILLed mid-play: the real Redis queue re-delivers its env, another
worker plays it, and nothing is lost or counted twice."""

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
from pathlib import Path

import pytest

from services.memory.service import MemoryService
from services.memory.store.sql import SqlStore, make_engine, migrate
from services.rollout.core.episode import EpisodeRunner, PlayLimits
from services.rollout.memory import MemoryServicePlays
from services.rollout.policy import FormatterTemplate
from services.rollout.state_store import RolloutStateStore
from services.rollout.worker import RolloutWorker, WorkerConfig
from spade.memory.records import NewEnvironment
from spade.queues.base import ENVS_READY, SAMPLES_AGENT
from spade.queues.config import RedisQueueConfig
from spade.queues.messages import decode, publish_proto
from spade.queues.redis_streams import RedisStreamQueue
from spade.v1 import queues_pb2
from tests.conftest import REDIS_URL
from tests.unit.rollout.envs import CountdownEnv
from tests.unit.rollout.players import LocalSessions, ScriptedPolicy

pytestmark = pytest.mark.slow

G = 2
ROOT = Path(__file__).resolve().parents[3]


async def test_a_killed_worker_process_loses_nothing(tmp_path: Path, template: FormatterTemplate) -> None:
    code = inspect.getsource(CountdownEnv)
    memory_url = f"sqlite:///{tmp_path / 'memory.db'}"
    state_url = f"sqlite:///{tmp_path / 'rollout.db'}"
    prefix = f"test-rollout-kill-{uuid.uuid4().hex[:8]}:"
    engine = make_engine(memory_url)
    migrate(engine)
    memory = MemoryService(SqlStore(engine))
    queue = RedisStreamQueue(RedisQueueConfig(url=REDIS_URL, prefix=prefix, claim_idle_ms=500))
    ready_file = tmp_path / "ready"
    proc: subprocess.Popen[bytes] | None = None
    try:
        put = await memory.put_environment(NewEnvironment(setting="game", skill="Optimization", code=code, hint="h"))
        await publish_proto(queue, ENVS_READY, queues_pb2.EnvReady(env_id=put.env_id, setting="game"), key=put.env_id)
        args = {
            "redis_url": REDIS_URL,
            "prefix": prefix,
            "memory_url": memory_url,
            "state_url": state_url,
            "ready_file": str(ready_file),
            "code": code,
            "group_size": str(G),
        }
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.rollout.hanging_worker", json.dumps(args)], cwd=ROOT
        )
        deadline = time.monotonic() + 180
        while not ready_file.exists():
            assert proc.poll() is None, "the worker process died before reaching mid-play"
            assert time.monotonic() < deadline, "the worker process never started playing"
            await asyncio.sleep(0.1)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        assert await queue.pending(ENVS_READY, "rollout") == 1  # delivered, never acknowledged

        adapter = MemoryServicePlays(memory)
        runner = EpisodeRunner(
            LocalSessions({code: CountdownEnv}),
            ScriptedPolicy(template, ["\\boxed{0}"], weight_version=None),
            template,
            PlayLimits(max_turns=2, max_tokens_per_turn=32),
        )
        store = RolloutStateStore.from_url(state_url)  # the dead worker's registration is in here
        survivor = RolloutWorker(
            queue, store, adapter, adapter, runner, WorkerConfig(consumer="survivor", group_size=G, block_ms=100)
        )
        for _ in range(100):
            if await survivor.step_envs():
                break
        store.dispose()
        got = await queue.consume(SAMPLES_AGENT, "learner", "l", count=100, block_ms=100)
        samples = [m for m in (decode(d) for d in got) if isinstance(m, queues_pb2.AgentSample)]
        assert len(samples) == 2 * G
        assert sorted(s.seed for s in samples if s.hinted) == sorted(s.seed for s in samples if not s.hinted)
        assert await queue.pending(ENVS_READY, "rollout") == 0
        plays, _ = await memory.plays(put.env_id)
        assert len(plays) == 2 * G
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(30)
        await queue.delete_all()
        await queue.close()
        engine.dispose()
