"""``spade serve learner`` as a real process: SIGTERM, kill -9 and restart, it never goes back in time.

Each test runs the memory's gRPC API in this process (SQLite, keys required, the run spec stored), the
real Redis, and the learner as its own ``spade serve learner`` process on the tiny checkpoint. The
test feeds agent samples into Redis and watches ``weights.published`` with its own consumer group.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from services.learner.buffer import read_buffer
from services.memory.core.policy import PolicyConfig
from services.memory.grpc_server import grpc_service
from services.memory.service import MemoryService
from services.memory.store.sql import SqlStore, make_engine, migrate
from spade.auth import KeyRing, Principal, Role, hash_key
from spade.queues.base import SAMPLES_AGENT, WEIGHTS_PUBLISHED
from spade.queues.config import RedisQueueConfig
from spade.queues.redis_streams import RedisStreamQueue
from spade.serving.grpc import grpc_server
from spade.serving.settings import ServerAddress
from spade.v1 import queues_pb2
from tests.conftest import REDIS_URL

from .conftest import SPEC, agent_sample

pytestmark = [pytest.mark.slow, pytest.mark.redis, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[3]
KEY = "learner-restart-test-key"
RETURNS = ([1, 0, 0, 1], [1, 1, 0, 0], [0, 1, 1, 0], [1, 0, 1, 0], [0, 0, 1, 1])


@pytest.fixture
async def memory_target(tmp_path: Path) -> AsyncIterator[str]:
    """The memory's gRPC API on a free port with the tests' run spec stored; yields ``host:port``."""
    engine = make_engine(f"sqlite:///{tmp_path / 'memory.db'}")
    migrate(engine)
    service = MemoryService(SqlStore(engine), PolicyConfig())
    await service.set_run_spec(SPEC)
    keys = KeyRing({hash_key(KEY): Principal("learner", Role.WRITE)})
    async with grpc_server(
        [grpc_service(service)], ServerAddress(port=0), service="memory", authenticate=keys.authenticate
    ) as running:
        yield f"127.0.0.1:{running.port}"
    engine.dispose()


@dataclass
class LearnerProcess:
    """One ``spade serve learner`` process and its log."""

    proc: asyncio.subprocess.Process
    log: Path

    def text(self) -> str:
        return self.log.read_text(errors="replace")


@dataclass
class Rig:
    """What the learner processes of one test share: directories, queue, memory, observer."""

    tmp: Path
    memory: str
    queue: dict[str, Any]
    observer: RedisStreamQueue
    runs: list[LearnerProcess] = field(default_factory=list)

    async def start(self, **settings: str) -> LearnerProcess:
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "SPADE_LEARNER_MODEL_PATH": str(self.tmp / "base"),
            "SPADE_LEARNER_QUEUE": json.dumps(self.queue),
            "SPADE_LEARNER_MEMORY": json.dumps({"target": self.memory, "api_key": KEY}),
            "SPADE_LEARNER_CHECKPOINT_DIR": str(self.tmp / "ckpt"),
            "SPADE_LEARNER_WEIGHTS_DIR": str(self.tmp / "weights"),
            "SPADE_LEARNER_AGENT_GROUPS_PER_STEP": "1",
            "SPADE_LEARNER_FILL_TIMEOUT_S": "0.5",
            "SPADE_LEARNER_LR": "1e-3",
            "SPADE_LEARNER_DEVICE": "cpu",
            "SPADE_LEARNER_KEEP_CHECKPOINTS": "10",
            "SPADE_LEARNER_KEEP_WEIGHTS": "10",
            "SPADE_LEARNER_WAIT_LOG_S": "2",
            **{f"SPADE_LEARNER_{k.upper()}": v for k, v in settings.items()},
        }
        log = self.tmp / f"learner-{len(self.runs)}.log"
        with log.open("wb") as out:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "spade.cli", "serve", "learner", cwd=ROOT, env=env, stdout=out, stderr=out
            )
        run = LearnerProcess(proc, log)
        self.runs.append(run)
        return run

    async def feed(self, group: int, plays: range = range(4)) -> None:
        """Group ``group``: an env's slot 0 with returns that vary (so it trains)."""
        queue = RedisStreamQueue(RedisQueueConfig.model_validate(self.queue))
        try:
            for seed in plays:
                msg = agent_sample(f"g{group}-{seed}", f"env{group}", seed, float(RETURNS[group][seed]), version=0)
                await queue.publish(SAMPLES_AGENT, msg.SerializeToString(), key=msg.sample_id)
        finally:
            await queue.close()

    async def announced(self, count: int, run: LearnerProcess, timeout_s: float = 300) -> list[int]:
        """The next ``count`` versions announced on ``weights.published`` (waits for them)."""
        versions: list[int] = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while len(versions) < count:
            assert run.proc.returncode is None, f"the learner exited with {run.proc.returncode}:\n{run.text()[-4000:]}"
            assert loop.time() < deadline, f"only {versions} were announced in {timeout_s} s:\n{run.text()[-4000:]}"
            for d in await self.observer.consume(WEIGHTS_PUBLISHED, "observer", "test", count=10, block_ms=500):
                message = queues_pb2.WeightsPublished.FromString(d.payload)
                assert message.spec_id == SPEC.spec_id
                versions.append(message.weight_version)
                await self.observer.ack(WEIGHTS_PUBLISHED, "observer", d.message_id)
        return versions

    async def state_version(self, version: int, run: LearnerProcess, timeout_s: float = 300) -> None:
        """Wait until the learner's state file shows ``version``."""
        path = self.tmp / "ckpt" / "learner_state.json"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not (path.is_file() and json.loads(path.read_text())["version"] >= version):
            assert run.proc.returncode is None, f"the learner exited with {run.proc.returncode}:\n{run.text()[-4000:]}"
            assert loop.time() < deadline, f"version {version} never trained:\n{run.text()[-4000:]}"
            await asyncio.sleep(0.2)


@pytest.fixture
async def rig(tmp_path: Path, base_model: Path, memory_target: str) -> AsyncIterator[Rig]:
    assert base_model == tmp_path / "base"
    queue = {"kind": "redis", "url": REDIS_URL, "prefix": f"test-restart-{uuid.uuid4().hex[:8]}:", "claim_idle_ms": 500}
    observer = RedisStreamQueue(RedisQueueConfig.model_validate(queue))
    await observer.consume(WEIGHTS_PUBLISHED, "observer", "test", block_ms=1)  # the group exists before any publish
    rig = Rig(tmp_path, memory_target, queue, observer)
    try:
        yield rig
    finally:
        for run in rig.runs:
            if run.proc.returncode is None:
                run.proc.kill()
                await run.proc.wait()
        await observer.delete_all()
        await observer.close()


async def stop(run: LearnerProcess, sig: int = signal.SIGTERM, bound_s: float = 60) -> int:
    """Send ``sig`` and wait (at most ``bound_s``) for the process to exit; returns its status."""
    run.proc.send_signal(sig)
    try:
        return await asyncio.wait_for(run.proc.wait(), timeout=bound_s)
    except TimeoutError:
        message = f"the learner did not exit within {bound_s} s of signal {sig}:\n{run.text()[-4000:]}"
        raise AssertionError(message) from None


def checkpoint_state(tmp: Path) -> dict[str, Any]:
    return json.loads((tmp / "ckpt" / "learner_state.json").read_text())


async def test_sigterm_after_v3_then_a_restart_resumes_at_v3_and_publishes_v4_next(rig: Rig) -> None:
    first = await rig.start()
    for group in range(3):
        await rig.feed(group)
    assert await rig.announced(3, first) == [1, 2, 3]
    assert await stop(first) == 0
    assert "checkpointed version 3" in first.text()

    ckpt = rig.tmp / "ckpt" / "step-00000003"
    v3 = load_file(str(rig.tmp / "weights" / "v00000003" / "model.safetensors"))
    saved = load_file(str(ckpt / "model" / "model.safetensors"))
    assert all(torch.equal(v3[k], saved[k]) for k in v3)  # the published v3 is the checkpointed state

    second = await rig.start()
    await rig.feed(3)
    assert await rig.announced(1, second) == [4]
    assert f"resumed from {ckpt} at weight version 3" in second.text()
    assert await stop(second) == 0
    state = checkpoint_state(rig.tmp)
    assert state["version"] == 4
    assert state["totals"]["agent_received"] == 16 and state["totals"].get("duplicates", 0) == 0
    assert state["totals"].get("redelivered", 0) == 0  # everything was acknowledged once durable


async def test_kill_9_resumes_from_the_last_checkpoint_and_never_publishes_an_existing_version(rig: Rig) -> None:
    settings = {"publish_every": "2", "checkpoint_every": "100"}
    first = await rig.start(**settings)
    for group in range(2):
        await rig.feed(group)
    assert await rig.announced(1, first) == [2]  # v1 trained only; v2 checkpointed, then published
    v2 = rig.tmp / "weights" / "v00000002" / "model.safetensors"
    v2_inode = v2.stat().st_ino
    await rig.feed(2)
    await rig.state_version(3, first)  # v3 trained from group 2: neither checkpointed nor published
    assert await stop(first, signal.SIGKILL) == -signal.SIGKILL

    second = await rig.start(**settings)
    await rig.feed(3)
    assert await rig.announced(1, second) == [4]  # v3 is trained again from the journal, then v4
    text = second.text()
    assert f"resumed from {rig.tmp / 'ckpt' / 'step-00000002'} at weight version 2" in text
    assert "replayed 4 messages from the sample journal" in text
    assert v2.stat().st_ino == v2_inode  # the published v2 was never written again
    assert await stop(second) == 0
    state = checkpoint_state(rig.tmp)
    assert state["version"] == 4
    # Every sample was trained on once in the surviving history: none lost, none twice.
    assert state["totals"]["agent_received"] == 16 and state["totals"].get("duplicates", 0) == 0


async def test_sigterm_while_waiting_for_samples_exits_within_its_bound_and_keeps_them(rig: Rig) -> None:
    first = await rig.start(fill_timeout_s="600")
    await rig.feed(0, range(2))  # half a group: the learner waits for the rest
    log = ""
    for _ in range(600):
        log = first.text()
        if "learner starting at weight version 0" in log:
            break
        assert first.proc.returncode is None, log[-4000:]
        await asyncio.sleep(0.2)
    await asyncio.sleep(2)  # inside the 600 s fill by now
    # What `spade cluster status` shows: the two plays wait in the learner (acknowledged, so not pending).
    buffer = None
    for _ in range(300):
        buffer = read_buffer(rig.tmp / "ckpt")
        if buffer is not None and buffer.plays_buffered == 2:
            break
        await asyncio.sleep(0.2)
    assert buffer is not None and (buffer.plays_buffered, buffer.groups_complete, buffer.version) == (2, 0, 0)
    assert buffer.plays_per_step == buffer.groups_per_step * buffer.group_size == 4
    assert await stop(first, bound_s=60) == 0  # one poll (<= 1 s) plus a checkpoint, not the fill's 600 s
    assert "learner stopped at weight version 0" in first.text()

    second = await rig.start()
    await rig.feed(0, range(2, 4))
    assert await rig.announced(1, second) == [1]  # the two plays received before SIGTERM were kept
    assert "replayed 2 messages from the sample journal" in second.text()


async def test_a_learner_whose_settings_contradict_the_run_spec_refuses_naming_the_field(rig: Rig) -> None:
    run = await rig.start(group_size="8", temperature=str(SPEC.temperature))
    assert await asyncio.wait_for(run.proc.wait(), timeout=300) == 2
    text = run.text()
    assert "the learner refuses to start" in text
    assert "group_size: this service is configured with 8 but the run spec has 4" in text
    assert "SPADE_LEARNER_GROUP_SIZE" in text and "temperature" not in text.split("refuses to start")[1]
    assert "Traceback" not in text
