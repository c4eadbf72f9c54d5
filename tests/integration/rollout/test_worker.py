"""A rollout worker against the real queues, the real memory service and the real state store.

The policy is scripted (real tokenizer ids; a real model cannot be steered to a reply) and trusted
test envs run in-process through ``LocalSessions`` to keep these scheduling tests fast; plays through
the real sandbox are in ``test_sandbox_play.py`` and ``test_embedded_model.py``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from services.memory.service import MemoryService
from services.memory.store.sql import SqlStore, make_engine, migrate
from services.rollout.core.episode import EpisodeRunner, PlayLimits
from services.rollout.core.ports import TurnSampling
from services.rollout.core.seeds import play_seeds
from services.rollout.memory import MemoryServicePlays
from services.rollout.policy import FormatterTemplate, Generation
from services.rollout.state_store import RolloutStateStore
from services.rollout.worker import RolloutWorker, WorkerConfig
from spade.memory.records import EnvStatus, NewEnvironment
from spade.queues.base import ENVS_READY, SAMPLES_AGENT, WEIGHTS_PUBLISHED, WorkQueue
from spade.queues.config import InProcessQueueConfig, RedisQueueConfig
from spade.queues.inprocess import InProcessQueue
from spade.queues.messages import decode, publish_proto
from spade.queues.redis_streams import RedisStreamQueue
from spade.retry import RetryPolicy
from spade.sandbox.errors import SandboxFault
from spade.v1 import queues_pb2
from tests.conftest import REDIS_URL
from tests.unit.rollout.envs import CountdownEnv
from tests.unit.rollout.players import LocalSessions, ScriptedPolicy

G = 3
K = 3
CODE = inspect.getsource(CountdownEnv)


@pytest.fixture
def memory(tmp_path: Path) -> Iterator[MemoryService]:
    engine = make_engine(f"sqlite:///{tmp_path / 'memory.db'}")
    migrate(engine)
    yield MemoryService(SqlStore(engine))
    engine.dispose()


@pytest.fixture(params=["inprocess", "redis"])
async def queue(request: pytest.FixtureRequest) -> AsyncIterator[WorkQueue]:
    if request.param == "inprocess":
        q: WorkQueue = InProcessQueue(InProcessQueueConfig(claim_idle_ms=300))
        yield q
        await q.close()
        return
    rq = RedisStreamQueue(
        RedisQueueConfig(url=REDIS_URL, prefix=f"test-rollout-{uuid.uuid4().hex[:8]}:", claim_idle_ms=300)
    )
    yield rq
    await rq.delete_all()
    await rq.close()


@dataclass
class Rig:
    queue: WorkQueue
    memory: MemoryService
    state_url: str
    template: FormatterTemplate
    sessions: LocalSessions

    def worker(self, name: str, policy: ScriptedPolicy | None = None) -> RolloutWorker:
        policy = policy or ScriptedPolicy(self.template, ["\\boxed{5}"], weight_version=None)
        runner = EpisodeRunner(self.sessions, policy, self.template, PlayLimits(max_turns=2, max_tokens_per_turn=32))
        adapter = MemoryServicePlays(self.memory)
        store = RolloutStateStore.from_url(self.state_url)
        config = WorkerConfig(consumer=name, group_size=G, window=K, block_ms=50, poll_s=0.05, lease_s=0.3)
        return RolloutWorker(self.queue, store, adapter, adapter, runner, config)

    async def put_env(self, version: int = 0) -> str:
        put = await self.memory.put_environment(
            NewEnvironment(setting="game", skill="Optimization", code=CODE, hint="Read it.", weight_version=version)
        )
        env = queues_pb2.EnvReady(env_id=put.env_id, setting="game", skill="Optimization", weight_version=version)
        await publish_proto(self.queue, ENVS_READY, env, key=put.env_id)
        return put.env_id

    async def publish_weights(self, version: int) -> None:
        await publish_proto(
            self.queue, WEIGHTS_PUBLISHED, queues_pb2.WeightsPublished(weight_version=version), key=f"w{version}"
        )

    async def samples(self) -> list[queues_pb2.AgentSample]:
        out: list[queues_pb2.AgentSample] = []
        while True:
            got = await self.queue.consume(SAMPLES_AGENT, "test-learner", "t", count=100, block_ms=20)
            if not got:
                return out
            for d in got:
                msg = decode(d)
                assert isinstance(msg, queues_pb2.AgentSample)
                out.append(msg)
                await self.queue.ack(SAMPLES_AGENT, "test-learner", d.message_id)


@pytest.fixture
def rig(queue: WorkQueue, memory: MemoryService, tmp_path: Path, template: FormatterTemplate) -> Rig:
    return Rig(queue, memory, f"sqlite:///{tmp_path / 'rollout.db'}", template, LocalSessions({CODE: CountdownEnv}))


async def test_first_version_plays_both_arms_on_the_same_seeds_and_the_same_count(rig: Rig) -> None:
    env_id = await rig.put_env(version=2)
    worker = rig.worker("w1")
    assert await worker.step_envs() == 1
    samples = await rig.samples()
    plain = sorted(s.seed for s in samples if not s.hinted)
    hinted = sorted(s.seed for s in samples if s.hinted)
    assert plain == hinted == sorted(play_seeds(env_id, 2, G))
    assert {s.group_id for s in samples} == {f"{env_id}@v2"}
    assert all(sum(s.loss_mask) > 0 and len(s.token_ids) == len(s.logprobs) == len(s.loss_mask) for s in samples)
    assert await rig.queue.pending(ENVS_READY, "rollout") == 0  # acked after everything was durable
    plays, _ = await rig.memory.plays(env_id)
    assert len(plays) == 2 * G and {p.weight_version for p in plays} == {2}
    stats = (await rig.memory.get_environment(env_id)).stats
    assert stats.regret is not None  # the memory pairs the arms seed by seed
    worker.store.dispose()


async def test_window_plays_fresh_seeds_at_each_new_version_then_retires(rig: Rig) -> None:
    env_id = await rig.put_env(version=0)
    worker = rig.worker("w1")
    await worker.step_envs()
    first = await rig.samples()
    assert await worker.step_window() == 0  # nothing newer published yet

    await rig.publish_weights(1)
    await worker.step_weights()
    assert await worker.step_window() == 1
    v1 = await rig.samples()
    assert len(v1) == G and not any(s.hinted for s in v1)
    assert {s.group_id for s in v1} == {f"{env_id}@v1"}
    assert {s.seed for s in v1}.isdisjoint({s.seed for s in first})
    assert await worker.step_window() == 0  # v1 is played once

    await rig.publish_weights(2)  # the last version of the window (0..2)
    await worker.step_weights()
    await worker.step_window()
    assert len(await rig.samples()) == G
    env = await rig.memory.get_environment(env_id)
    assert env.status is EnvStatus.RETIRED
    assert env.stats.window_plays == 3 * G
    await rig.publish_weights(3)
    await worker.step_weights()
    assert await worker.step_window() == 0 and await rig.samples() == []
    worker.store.dispose()


async def test_the_active_set_survives_a_restart_of_the_rollout(rig: Rig) -> None:
    env_id = await rig.put_env(version=0)
    before = rig.worker("w1")
    await before.step_envs()
    before.store.dispose()  # the process goes away; the queue and the databases stay

    await rig.publish_weights(1)
    after = rig.worker("w1-restarted")
    await after.step_weights()
    assert await after.step_window() == 1
    samples = await rig.samples()
    assert {s.group_id for s in samples} == {f"{env_id}@v0", f"{env_id}@v1"}
    assert len(samples) == 2 * G + G
    after.store.dispose()


class _Hang(ScriptedPolicy):
    """A policy that stalls forever on its second call (a worker that dies mid-play)."""

    started: asyncio.Event

    async def generate(self, input_ids: list[int], sampling: TurnSampling) -> Generation:
        if len(self.calls) >= 1:
            self.started.set()
            await asyncio.Event().wait()
        return await super().generate(input_ids, sampling)


async def test_a_worker_dying_mid_play_loses_nothing_another_worker_replays_it(rig: Rig) -> None:
    env_id = await rig.put_env(version=0)
    hang = _Hang(rig.template, ["\\boxed{5}"], weight_version=None)
    hang.started = asyncio.Event()
    doomed = rig.worker("doomed", hang)
    task = asyncio.create_task(doomed.step_envs())
    await asyncio.wait_for(hang.started.wait(), 30)
    task.cancel()  # killed mid-play: no ack, nothing published or recorded
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await rig.samples() == []
    assert await rig.queue.pending(ENVS_READY, "rollout") == 1

    survivor = rig.worker("survivor")
    for _ in range(100):  # the queue re-delivers once the dead consumer is idle for claim_idle_ms
        if await survivor.step_envs():
            break
        await asyncio.sleep(0.05)
    samples = await rig.samples()
    assert len(samples) == 2 * G
    assert sorted(s.seed for s in samples if s.hinted) == sorted(s.seed for s in samples if not s.hinted)
    assert await rig.queue.pending(ENVS_READY, "rollout") == 0
    plays, _ = await rig.memory.plays(env_id)
    assert len(plays) == 2 * G
    doomed.store.dispose()
    survivor.store.dispose()


async def test_a_redelivered_env_whose_plays_are_done_is_not_played_again(rig: Rig) -> None:
    env_id = await rig.put_env(version=0)
    worker = rig.worker("w1")
    await worker.step_envs()
    assert len(await rig.samples()) == 2 * G
    # The same env announced again (a designer retry): registered once, played once.
    await publish_proto(
        rig.queue,
        ENVS_READY,
        queues_pb2.EnvReady(env_id=env_id, setting="game", weight_version=0),
        key=f"{env_id}-again",
    )
    assert await worker.step_envs() == 1
    assert await rig.samples() == []
    worker.store.dispose()


async def test_an_env_missing_from_the_memory_is_dropped_not_retried_forever(rig: Rig) -> None:
    await publish_proto(rig.queue, ENVS_READY, queues_pb2.EnvReady(env_id="nope", setting="game"), key="nope")
    worker = rig.worker("w1")
    assert await worker.step_envs() == 1
    assert await rig.queue.pending(ENVS_READY, "rollout") == 0
    assert await worker.store.get("nope") is None
    worker.store.dispose()


async def test_a_sandbox_fault_is_retried_and_the_play_counted_once(rig: Rig) -> None:
    env_id = await rig.put_env(version=0)
    seeds = play_seeds(env_id, 0, G)
    rig.sessions.fault_on.add(seeds[0])
    worker = rig.worker("w1")
    await worker.step_envs()
    samples = await rig.samples()
    assert len(samples) == 2 * G
    assert [s for _, _, s in rig.sessions.opened].count(seeds[0]) == 3  # faulted once, then both arms
    worker.store.dispose()


async def test_hinted_plays_can_be_kept_off_the_training_stream(rig: Rig) -> None:
    env_id = await rig.put_env(version=0)
    worker = rig.worker("w1")
    worker.config = dataclasses.replace(worker.config, publish_hinted=False)
    await worker.step_envs()
    samples = await rig.samples()
    assert len(samples) == G and not any(s.hinted for s in samples)
    plays, _ = await rig.memory.plays(env_id)
    assert sum(p.hinted for p in plays) == G  # still recorded: regret needs them
    worker.store.dispose()


async def test_plays_spanning_weight_versions_are_labelled_with_the_oldest_or_dropped(rig: Rig) -> None:
    await rig.put_env(version=0)
    # Weights move from 4 to 5 between the two turns of every play.
    policy = ScriptedPolicy(rig.template, ["\\boxed{0}"], versions=lambda turn: 4 + turn % 2)
    worker = rig.worker("w1", policy)
    await worker.step_envs()
    samples = await rig.samples()
    assert len(samples) == 2 * G and {s.weight_version for s in samples} == {4}
    assert await worker.store.latest_version() == 5  # the server's version is learnt from generations

    await rig.put_env(version=0)
    dropping = rig.worker("w2", ScriptedPolicy(rig.template, ["\\boxed{0}"], versions=lambda turn: 4 + turn % 2))
    dropping.config = dataclasses.replace(dropping.config, drop_mixed_versions=True)
    await dropping.step_envs()
    assert await rig.samples() == []
    worker.store.dispose()
    dropping.store.dispose()


async def test_run_serves_every_stream_until_stopped(rig: Rig) -> None:
    env_id = await rig.put_env(version=0)
    worker = rig.worker("w1")
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    samples: list[queues_pb2.AgentSample] = []
    for _ in range(400):
        samples += await rig.samples()
        if len(samples) >= 2 * G:
            break
        await asyncio.sleep(0.02)
    await rig.publish_weights(1)
    for _ in range(400):
        samples += await rig.samples()
        if len(samples) >= 3 * G:
            break
        await asyncio.sleep(0.02)
    stop.set()
    await asyncio.wait_for(task, 30)
    assert sorted({s.group_id for s in samples}) == [f"{env_id}@v0", f"{env_id}@v1"]
    assert len(samples) == 3 * G
    worker.store.dispose()


async def test_an_env_whose_first_plays_keep_failing_is_closed_not_redelivered_forever(rig: Rig) -> None:
    env_id = await rig.put_env(version=0)
    rig.sessions.fault_on.update(play_seeds(env_id, 0, G))  # every first session of every seed faults
    worker = rig.worker("w1")
    worker.config = dataclasses.replace(worker.config, play_retry=RetryPolicy(attempts=1), max_deliveries=1)
    with pytest.raises(SandboxFault):
        await worker.step_envs()  # delivery 1 fails: left pending
    for _ in range(100):  # delivery 2 (after claim_idle_ms) exceeds max_deliveries
        if await worker.step_envs():
            break
        await asyncio.sleep(0.05)
    assert await rig.queue.pending(ENVS_READY, "rollout") == 0
    assert await worker.step_window() == 1  # the closed window is reported to the memory
    assert (await rig.memory.get_environment(env_id)).status is EnvStatus.RETIRED
    assert await rig.samples() == []
    worker.store.dispose()
