"""A rollout worker against the real queues, the real memory service and the real state store.

The policy is scripted (real tokenizer ids; a real model cannot be steered to a reply) and trusted
test envs run in-process through ``LocalSessions`` to keep these scheduling tests fast; plays through
the real sandbox are in ``test_sandbox_play.py``, ``test_embedded_model.py`` and the process tests in
``test_worker_killed.py``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import socket
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from services.memory.service import MemoryService
from services.memory.store.sql import SqlStore, make_engine, migrate
from services.rollout.core.episode import EpisodeRunner, PlayLimits
from services.rollout.core.ports import TurnSampling
from services.rollout.core.schedule import EnvStatus
from services.rollout.core.seeds import play_seeds
from services.rollout.memory import MemoryServicePlays
from services.rollout.policy import FormatterTemplate, Generation
from services.rollout.state_store import RolloutStateStore
from services.rollout.worker import RolloutWorker, WorkerConfig
from spade.dependencies import Dependency
from spade.inference import derive_sampling_seed
from spade.inference.client import InferenceUnavailable
from spade.memory.records import EnvStatus as MemoryEnvStatus
from spade.memory.records import NewEnvironment
from spade.queues.base import ENVS_READY, SAMPLES_AGENT, WEIGHTS_PUBLISHED, WorkQueue
from spade.queues.config import InProcessQueueConfig, RedisQueueConfig
from spade.queues.inprocess import InProcessQueue
from spade.queues.messages import decode, publish_proto
from spade.queues.redis_streams import RedisStreamQueue
from spade.retry import RetryPolicy
from spade.runspec import RunSpec
from spade.v1 import queues_pb2
from tests.conftest import REDIS_URL
from tests.unit.rollout.envs import CountdownEnv
from tests.unit.rollout.players import LocalSessions, ScriptedPolicy

G = 3
K = 3
CODE = inspect.getsource(CountdownEnv)
SPEC = RunSpec(group_size=G, window_versions_game=K, agent_max_turns=2, agent_max_tokens_per_turn=32)


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

    def worker(self, name: str, policy: ScriptedPolicy | None = None, **config: Any) -> RolloutWorker:
        policy = policy or ScriptedPolicy(self.template, ["\\boxed{5}"], weight_version=None)
        limits = PlayLimits(max_turns=SPEC.agent_max_turns, max_tokens_per_turn=SPEC.agent_max_tokens_per_turn)
        runner = EpisodeRunner(self.sessions, policy, self.template, limits)
        store = RolloutStateStore.from_url(self.state_url)
        base = WorkerConfig(consumer=name, spec=SPEC, block_ms=50, poll_s=0.05, lease_s=1.0)
        return RolloutWorker(
            self.queue, store, MemoryServicePlays(self.memory), runner, dataclasses.replace(base, **config)
        )

    async def put_env(self, version: int = 0, spec_id: str | None = None, variant: str = "") -> str:
        code = CODE + (f"\nVARIANT = {variant!r}\n" if variant else "")  # the memory stores one env per program
        self.sessions.classes[code] = CountdownEnv
        put = await self.memory.put_environment(
            NewEnvironment(setting="game", skill="Optimization", code=code, hint="Read it.", weight_version=version)
        )
        env = queues_pb2.EnvReady(
            env_id=put.env_id,
            setting="game",
            skill="Optimization",
            weight_version=version,
            spec_id=SPEC.spec_id if spec_id is None else spec_id,
        )
        await publish_proto(self.queue, ENVS_READY, env, key=put.env_id)
        return put.env_id

    async def publish_weights(self, version: int) -> None:
        msg = queues_pb2.WeightsPublished(weight_version=version, spec_id=SPEC.spec_id)
        await publish_proto(self.queue, WEIGHTS_PUBLISHED, msg, key=f"w{version}")

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


async def drain(worker: RolloutWorker) -> None:
    """What the embedded run does each step: weights, announcements, then every due slot."""
    await worker.step_weights()
    while await worker.step_envs():
        pass
    while await worker.step_window():
        pass


async def test_first_plays_fix_the_window_and_play_both_arms_on_the_same_seeds(rig: Rig) -> None:
    env_id = await rig.put_env(version=2)
    policy = ScriptedPolicy(rig.template, ["\\boxed{0}"], weight_version=None)  # never wins: two turns each
    worker = rig.worker("w1", policy)
    assert await worker.step_envs() == 1
    assert await rig.queue.pending(ENVS_READY, "rollout") == 0  # acked once durable in the state store
    assert await worker.step_window() == 1
    samples = await rig.samples()
    plain = sorted(s.seed for s in samples if not s.hinted)
    hinted = sorted(s.seed for s in samples if s.hinted)
    assert plain == hinted == sorted(play_seeds(env_id, 0, G))
    assert {(s.group_id, s.window_start, s.window_index, s.spec_id) for s in samples} == {
        (f"{env_id}@s0", 2, 0, SPEC.spec_id)
    }
    assert all(sum(s.loss_mask) > 0 and len(s.token_ids) == len(s.logprobs) == len(s.loss_mask) for s in samples)
    stored = await rig.memory.get_environment(env_id)
    assert (stored.window_start, stored.window_versions) == (2, K)
    plays, _ = await rig.memory.plays(env_id)
    assert len(plays) == 2 * G and {(p.window_start, p.window_index, p.spec_id) for p in plays} == {
        (2, 0, SPEC.spec_id)
    }
    assert stored.stats.regret is not None  # the memory pairs slot 0's two arms seed by seed
    # Every model turn was seeded from (run, env, slot version, seed, arm, turn).
    arms, turns = ("plain", "hint"), (0, 1)
    expected = {derive_sampling_seed(SPEC.spec_id, env_id, 2, s, a, t) for s in plain for a in arms for t in turns}
    assert sorted(sampling.seed or 0 for _, sampling in policy.calls) == sorted(expected)
    worker.store.dispose()


async def test_version_drift_between_design_and_first_play_keeps_the_envs_own_window(rig: Rig) -> None:
    env_id = await rig.put_env(version=0)
    worker = rig.worker("w1")
    await worker.step_envs()
    await rig.publish_weights(1)  # the learner publishes twice before the rollout plays the env
    await rig.publish_weights(2)
    await worker.step_weights()
    await worker.step_window()
    samples = await rig.samples()
    assert len(samples) == 2 * G
    # Slot 0 (both arms) is at the version current at the first play, not the designing version.
    assert {(s.window_start, s.window_index, s.hinted) for s in samples} == {(2, 0, False), (2, 0, True)}
    env = await rig.memory.get_environment(env_id)
    assert env.window_start == 2 and env.stats.regret is not None
    worker.store.dispose()


async def test_window_slots_play_fresh_seeds_at_each_new_version_then_retire(rig: Rig) -> None:
    env_id = await rig.put_env(version=0)
    worker = rig.worker("w1")
    await drain(worker)
    first = await rig.samples()
    assert await worker.step_window() == 0  # nothing newer published yet

    await rig.publish_weights(1)
    await drain(worker)
    s1 = await rig.samples()
    assert len(s1) == G and not any(s.hinted for s in s1)
    assert {(s.group_id, s.window_index) for s in s1} == {(f"{env_id}@s1", 1)}
    assert {s.seed for s in s1}.isdisjoint({s.seed for s in first})
    assert await worker.step_window() == 0  # slot 1 is played once

    await rig.publish_weights(2)  # the last slot of the window (0..2)
    await drain(worker)
    assert len(await rig.samples()) == G
    env = await rig.memory.get_environment(env_id)
    assert env.status is MemoryEnvStatus.RETIRED
    assert env.stats.window_plays == 3 * G
    await rig.publish_weights(3)
    await drain(worker)
    assert await rig.samples() == []
    worker.store.dispose()


async def test_slots_whose_version_passed_are_played_late_under_their_index_none_skipped(rig: Rig) -> None:
    env_id = await rig.put_env(version=0)
    worker = rig.worker("w1")
    await drain(worker)
    await rig.samples()
    await rig.publish_weights(7)  # the rollout missed versions 1..6: slots 1 and 2 are both due, late
    await drain(worker)
    samples = await rig.samples()
    assert sorted({s.window_index for s in samples}) == [1, 2] and len(samples) == 2 * G
    assert worker.counts.late_slots == 2 and worker.counts.skipped_slots == 0
    assert await worker.store.skipped(env_id) == []
    plays, _ = await rig.memory.plays(env_id)
    assert sorted({p.window_index for p in plays}) == [0, 1, 2]
    assert (await rig.memory.get_environment(env_id)).status is MemoryEnvStatus.RETIRED
    worker.store.dispose()


async def test_the_active_set_survives_a_restart_of_the_rollout(rig: Rig) -> None:
    env_id = await rig.put_env(version=0)
    before = rig.worker("w1")
    await drain(before)
    before.store.dispose()  # the process goes away; the queue and the databases stay

    await rig.publish_weights(1)
    after = rig.worker("w1")
    await drain(after)
    samples = await rig.samples()
    assert {s.group_id for s in samples} == {f"{env_id}@s0", f"{env_id}@s1"}
    assert len(samples) == 2 * G + G
    after.store.dispose()


class _Hang(ScriptedPolicy):
    """A policy that stalls forever once it has answered ``answer`` turns (a worker that dies mid-play)."""

    started: asyncio.Event
    answer: int = 1

    async def generate(self, input_ids: list[int], sampling: TurnSampling) -> Generation:
        if len(self.calls) >= self.answer:
            self.started.set()
            await asyncio.Event().wait()
        return await super().generate(input_ids, sampling)


def _hanging(rig: Rig, answer: int) -> _Hang:
    hang = _Hang(rig.template, ["\\boxed{0}"], weight_version=None)  # never wins: every play takes two turns
    hang.started, hang.answer = asyncio.Event(), answer
    return hang


async def _finished(worker: RolloutWorker, env_id: str, plays: int) -> None:
    """Wait until ``plays`` plays of slot 0 are published, recorded and marked done."""
    for _ in range(600):
        if len(await worker.store.done_plays(env_id, 0)) >= plays:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{plays} plays never finished")


async def _die_mid_play(rig: Rig, env_id: str, answer: int = 1) -> RolloutWorker:
    """A worker that registers the env and dies while its first plays are in flight."""
    hang = _hanging(rig, answer)
    doomed = rig.worker("doomed", hang, max_concurrent_plays=1)
    await doomed.step_envs()
    task = asyncio.create_task(doomed.step_window())
    await asyncio.wait_for(hang.started.wait(), 30)
    await _finished(doomed, env_id, (answer - 1) // 2)

    async def killed(*args: object, **kwargs: object) -> None:
        return None  # SIGKILL runs no clean-up: the lease stays with the dead worker

    doomed.store.release = killed  # type: ignore[method-assign]
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    return doomed


async def test_a_dead_workers_slot_is_resumed_at_once_under_its_own_name(rig: Rig) -> None:
    env_id = await rig.put_env(version=0)
    doomed = await _die_mid_play(rig, env_id, answer=2 * 2 + 1)  # two plays of two turns finished, the third hangs
    owner, _ = await doomed.store.lease(env_id)
    assert owner == "doomed"
    before = len(await rig.samples())
    assert before == 2  # finished plays are published (and recorded) one by one
    restarted = rig.worker("doomed", lease_s=600)  # same name, long lease: it does not wait for it
    assert await restarted.step_window() == 1
    samples = await rig.samples()
    assert before + len(samples) == 2 * G  # only the missing plays were played again
    plays, _ = await rig.memory.plays(env_id)
    assert len(plays) == 2 * G and len({p.trajectory_id for p in plays}) == 2 * G
    doomed.store.dispose()
    restarted.store.dispose()


async def test_a_dead_workers_slot_is_taken_over_by_another_within_one_lease(rig: Rig) -> None:
    env_id = await rig.put_env(version=0)
    doomed = await _die_mid_play(rig, env_id)
    survivor = rig.worker("survivor")
    assert await survivor.step_window() == 0  # the lease (1 s) is still the dead worker's
    for _ in range(100):
        if await survivor.step_window():
            break
        await asyncio.sleep(0.05)
    samples = await rig.samples()
    assert len(samples) == 2 * G
    assert sorted(s.seed for s in samples if s.hinted) == sorted(s.seed for s in samples if not s.hinted)
    plays, _ = await rig.memory.plays(env_id)
    assert len(plays) == 2 * G
    doomed.store.dispose()
    survivor.store.dispose()


async def test_stopping_mid_work_keeps_finished_plays_and_hands_the_lease_over_at_once(rig: Rig) -> None:
    env_id = await rig.put_env(version=0)
    hang = _hanging(rig, answer=2 * 2 + 1)
    worker = rig.worker("stopping", hang, max_concurrent_plays=1, shutdown_grace_s=0.2, lease_s=600)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    await asyncio.wait_for(hang.started.wait(), 30)
    await _finished(worker, env_id, 2)
    stop.set()
    await asyncio.wait_for(task, 30)  # the grace is 0.2 s: the hanging play is cancelled
    assert worker.counts.released_on_stop == 1
    assert await worker.store.lease(env_id) == (None, None)
    kept = await rig.samples()
    assert len(kept) == 2
    other = rig.worker("other", lease_s=600)
    assert await other.step_window() == 1  # at once: the stopping worker handed its lease back
    assert len(kept) + len(await rig.samples()) == 2 * G
    worker.store.dispose()
    other.store.dispose()


async def test_a_worker_that_lost_its_lease_stops_its_plays(rig: Rig) -> None:
    env_id = await rig.put_env(version=0)
    hang = _hanging(rig, answer=1)
    slow = rig.worker("slow", hang, lease_s=0.3)
    await slow.step_envs()
    task = asyncio.create_task(slow.step_window())
    await asyncio.wait_for(hang.started.wait(), 30)
    await slow.store.release(env_id, "slow")
    assert await slow.store.claim("thief", 600) is not None  # another worker took the slot over
    assert await asyncio.wait_for(task, 30) == 1  # the next heartbeat notices and stops the plays
    assert slow.counts.lost_leases == 1
    assert await rig.samples() == []
    slow.store.dispose()


async def test_a_redelivered_env_is_registered_once_and_played_once(rig: Rig) -> None:
    env_id = await rig.put_env(version=0)
    worker = rig.worker("w1")
    await drain(worker)
    assert len(await rig.samples()) == 2 * G
    # The same env announced again (a designer retry): registered once, played once.
    again = queues_pb2.EnvReady(env_id=env_id, setting="game", weight_version=0, spec_id=SPEC.spec_id)
    await publish_proto(rig.queue, ENVS_READY, again, key=f"{env_id}-again")
    await drain(worker)
    assert await rig.samples() == []
    worker.store.dispose()


async def test_envs_of_another_run_spec_or_missing_from_the_memory_are_refused_with_a_reason(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    foreign = await rig.put_env(version=0, spec_id="0123456789abcdef", variant="foreign")
    await publish_proto(rig.queue, ENVS_READY, queues_pb2.EnvReady(env_id="nope", setting="game"), key="nope")
    worker = rig.worker("w1")
    with caplog.at_level(logging.ERROR, logger="spade.rollout"):
        await drain(worker)
    assert await rig.queue.pending(ENVS_READY, "rollout") == 0
    assert await worker.store.get(foreign) is None and await worker.store.get("nope") is None
    reasons = [str(r.__dict__["reason"]) for r in caplog.records if r.__dict__.get("event") == "env_refused"]
    assert sorted(reasons) == ["announced under another run spec", "the memory does not hold it"]
    assert worker.counts.refused_envs == 1 and await rig.samples() == []
    worker.store.dispose()


async def test_a_sandbox_fault_is_retried_and_the_play_counted_once(rig: Rig) -> None:
    env_id = await rig.put_env(version=0)
    seeds = play_seeds(env_id, 0, G)
    rig.sessions.fault_on.add(seeds[0])
    worker = rig.worker("w1")
    await drain(worker)
    samples = await rig.samples()
    assert len(samples) == 2 * G
    assert [s for _, _, s in rig.sessions.opened].count(seeds[0]) == 3  # faulted once, then both arms
    plays, _ = await rig.memory.plays(env_id)
    assert len(plays) == 2 * G and "sandbox_fault" not in {p.finish_reason for p in plays}
    worker.store.dispose()


async def test_hinted_plays_can_be_kept_off_the_training_stream(rig: Rig) -> None:
    env_id = await rig.put_env(version=0)
    worker = rig.worker("w1", publish_hinted=False)
    await drain(worker)
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
    await drain(worker)
    samples = [s for s in await rig.samples() if s.window_index == 0]
    assert len(samples) == 2 * G and {s.weight_version for s in samples} == {4}
    assert {s.window_start for s in samples} == {0}  # scored under the env's window, whatever generated it
    assert await worker.store.latest_version() == 5  # the server's version is learnt from generations

    second = await rig.put_env(version=0, variant="second")
    dropping = rig.worker(
        "w2", ScriptedPolicy(rig.template, ["\\boxed{0}"], versions=lambda turn: 4 + turn % 2), drop_mixed_versions=True
    )
    await drain(dropping)
    assert await rig.samples() == []  # every play spans two versions: none is sent to the learner
    plays, _ = await rig.memory.plays(second)
    assert len([p for p in plays if p.window_index == 0]) == 2 * G  # still recorded
    assert {p.window_start for p in plays} == {5}  # its window starts at the version current at its first play
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
    assert sorted({s.group_id for s in samples}) == [f"{env_id}@s0", f"{env_id}@s1"]
    assert len(samples) == 3 * G
    worker.store.dispose()


async def test_an_env_whose_first_plays_keep_failing_is_closed_with_the_reason_recorded(rig: Rig) -> None:
    env_id = await rig.put_env(version=0)
    seeds = play_seeds(env_id, 0, G)
    worker = rig.worker("w1", play_retry=RetryPolicy(attempts=1), max_attempts=2, lease_s=0.05)
    await worker.step_envs()
    for attempt in range(3):  # two failed claims, then the third gives up and closes the window
        rig.sessions.fault_on.update(seeds)  # every first session of every seed faults, every time
        assert await worker.step_window() >= 1, attempt
        await asyncio.sleep(0.1)  # the failed slot is held back for lease_s
    assert (await rig.memory.get_environment(env_id)).status is MemoryEnvStatus.RETIRED
    skipped = await worker.store.skipped(env_id)
    assert [s.slot for s in skipped] == [0, 1, 2] and "failed on 2 claims" in skipped[0].reason
    assert "SandboxFault" in skipped[0].reason
    assert (await worker.store.get(env_id)).status is EnvStatus.RETIRED  # type: ignore[union-attr]
    worker.store.dispose()


@pytest.mark.parametrize("sandbox_up", [True, False])
async def test_sandbox_faults_count_against_a_slot_only_while_the_sandbox_answers(rig: Rig, sandbox_up: bool) -> None:
    """A sandbox fault may be the env's doing (poison work, given up after ``max_attempts``), unless the
    sandbox is unreachable right after it: then it was an outage and the slot waits it out."""
    env_id = await rig.put_env(version=0)
    seeds = play_seeds(env_id, 0, G)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        if sandbox_up:
            listener.listen()
        sandbox = Dependency("tcp", f"127.0.0.1:{listener.getsockname()[1]}", timeout_s=1.0)
        worker = rig.worker("w1", play_retry=RetryPolicy(attempts=1), max_attempts=2, lease_s=0.05)
        worker.dependencies = (sandbox,)
        await worker.step_envs()
        for _ in range(4):
            rig.sessions.fault_on.update(seeds)  # every first session of every seed faults, every time
            claimed = await worker.step_window()
            assert sandbox_up or claimed == 1  # while the sandbox is down, every try is a real claim that fails
            await asyncio.sleep(0.1)  # the failed slot is held back for lease_s
    rig.sessions.fault_on.clear()
    await drain(worker)
    status = (await worker.store.get(env_id)).status  # type: ignore[union-attr]
    if sandbox_up:  # two failed claims, the third gave up: the window closed unplayed
        assert status is EnvStatus.RETIRED and [s.slot for s in await worker.store.skipped(env_id)] == [0, 1, 2]
    else:  # four outages later the slot is still due, and is played once the sandbox is back
        assert await worker.store.skipped(env_id) == []
        assert len({s.sample_id for s in await rig.samples() if s.window_index == 0}) == 2 * G  # both arms, every seed
    worker.store.dispose()


async def test_an_unreachable_inference_server_never_makes_a_slot_poison(rig: Rig) -> None:
    env_id = await rig.put_env(version=0)
    policy = DownPolicy(rig.template, ["\\boxed{5}"], weight_version=None, down=True)
    worker = rig.worker("w1", policy, play_retry=RetryPolicy(attempts=1), max_attempts=1, lease_s=0.05)
    await worker.step_envs()
    for _ in range(4):  # four claims fail with InferenceUnavailable; with max_attempts=1 the second would give up
        assert await worker.step_window() == 1
        await asyncio.sleep(0.1)
    assert policy.refused >= 4
    policy.down = False
    await drain(worker)
    assert await worker.store.skipped(env_id) == []
    assert len(await rig.samples()) == 2 * G
    worker.store.dispose()


@dataclass
class DownPolicy(ScriptedPolicy):
    """A scripted policy whose server is unreachable while ``down``."""

    down: bool = False
    refused: int = 0

    async def generate(self, input_ids: list[int], sampling: TurnSampling) -> Generation:
        if self.down:
            self.refused += 1
            raise InferenceUnavailable("no inference server answered (the test's outage)")
        return await super().generate(input_ids, sampling)


async def test_a_later_slot_that_keeps_failing_is_skipped_with_its_reason_and_the_window_goes_on(rig: Rig) -> None:
    env_id = await rig.put_env(version=0)
    worker = rig.worker("w1", play_retry=RetryPolicy(attempts=1), max_attempts=1, lease_s=0.05)
    await drain(worker)
    await rig.samples()
    await rig.publish_weights(2)
    rig.sessions.fault_on.update(play_seeds(env_id, 1, G))
    await worker.step_weights()
    assert await worker.step_window() == 1  # slot 1 fails
    await asyncio.sleep(0.1)
    await drain(worker)  # slot 1 skipped with its reason, slot 2 played, window closed
    assert {s.window_index for s in await rig.samples()} == {2}
    assert [(s.slot, "SandboxFault" in s.reason) for s in await worker.store.skipped(env_id)] == [(1, True)]
    assert (await rig.memory.get_environment(env_id)).status is MemoryEnvStatus.RETIRED
    worker.store.dispose()


async def test_one_structured_line_per_play(rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    env_id = await rig.put_env(version=0)
    worker = rig.worker("w1")
    with caplog.at_level(logging.INFO, logger="spade.rollout"):
        await drain(worker)
    plays = [r.__dict__ for r in caplog.records if r.__dict__.get("event") == "play"]
    assert len(plays) == 2 * G
    fields = {"env_id", "version", "window_start", "window_index", "arm", "seed", "episode_return", "turns"}
    assert all(fields | {"finish_reason", "spec_id"} <= set(p) for p in plays)
    assert {(p["env_id"], p["window_index"], p["spec_id"]) for p in plays} == {(env_id, 0, SPEC.spec_id)}
    assert sorted(p["arm"] for p in plays) == ["hint"] * G + ["plain"] * G
    worker.store.dispose()
