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
import random
import socket
import uuid
from collections.abc import AsyncIterator, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from services.memory.service import MemoryService
from services.memory.store.sql import SqlStore, make_engine, migrate
from services.rollout.core.schedule import EnvStatus
from services.rollout.core.seeds import play_seeds
from services.rollout.memory import MemoryServicePlays
from services.rollout.policy import FormatterTemplate, Generation
from services.rollout.samples import SlotRef, sample_id
from services.rollout.state_store import Claim, RolloutStateStore
from services.rollout.worker import RolloutWorker, WorkerConfig
from spade.agent.episode import EpisodeRunner, PlayLimits
from spade.agent.ports import TurnSampling
from spade.dependencies import Dependency
from spade.envs.types import Setting
from spade.inference import derive_sampling_seed
from spade.inference.client import InferenceUnavailable
from spade.memory.records import EnvStatus as MemoryEnvStatus
from spade.memory.records import NewEnvironment
from spade.queues.base import ENVS_AUDITED, ENVS_READY, SAMPLES_AGENT, WEIGHTS_PUBLISHED, WorkQueue
from spade.queues.config import InProcessQueueConfig, RedisQueueConfig
from spade.queues.inprocess import InProcessQueue
from spade.queues.messages import decode, publish_proto
from spade.queues.redis_streams import RedisStreamQueue
from spade.retry import RetryPolicy
from spade.runspec import RunSpec
from spade.v1 import queues_pb2, types_pb2
from tests.conftest import REDIS_URL
from tests.unit.rollout.envs import CountdownEnv, ForgingEnv, VaultEnv
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


@pytest.fixture(params=["inprocess", pytest.param("redis", marks=pytest.mark.redis)])
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

    async def put_env(
        self, version: int = 0, spec_id: str | None = None, variant: str = "", *, announce: bool = True
    ) -> str:
        code = CODE + (f"\nVARIANT = {variant!r}\n" if variant else "")  # the memory stores one env per program
        self.sessions.classes[code] = CountdownEnv
        put = await self.memory.put_environment(
            NewEnvironment(
                setting=Setting.GAME, skill="Optimization", code=code, hint="Read it.", weight_version=version
            )
        )
        if announce:
            await self.announce(put.env_id, version, spec_id)
        return put.env_id

    async def announce(self, env_id: str, version: int = 0, spec_id: str | None = None) -> None:
        env = queues_pb2.EnvReady(
            env_id=env_id,
            setting=types_pb2.SETTING_GAME,
            skill="Optimization",
            weight_version=version,
            spec_id=SPEC.spec_id if spec_id is None else spec_id,
        )
        await publish_proto(self.queue, ENVS_READY, env, key=env_id)

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
    await worker.play_due()


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


async def test_a_dead_workers_slot_is_resumed_at_once_under_its_own_name(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    env_id = await rig.put_env(version=0)
    doomed = await _die_mid_play(rig, env_id, answer=2 * 2 + 1)  # two plays of two turns finished, the third hangs
    owner, _ = await doomed.store.lease(env_id)
    assert owner == "doomed"
    before = len(await rig.samples())
    assert before == 2  # finished plays are published (and recorded) one by one
    restarted = rig.worker("doomed", lease_s=600)  # same name, long lease: it does not wait for it
    with caplog.at_level(logging.INFO, logger="spade.serving.lifecycle"):
        assert await restarted.step_window() == 1
    (said,) = [r for r in caplog.records if r.name == "spade.serving.lifecycle"]
    assert said.event == "resumed" and (said.env_id, said.slot) == (env_id, 0)  # type: ignore[attr-defined]
    samples = await rig.samples()
    assert before + len(samples) == 2 * G  # only the missing plays were played again
    plays, _ = await rig.memory.plays(env_id)
    assert len(plays) == 2 * G and len({p.trajectory_id for p in plays}) == 2 * G
    doomed.store.dispose()
    restarted.store.dispose()


async def test_a_dead_workers_slot_is_taken_over_by_another_within_one_lease(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    env_id = await rig.put_env(version=0)
    doomed = await _die_mid_play(rig, env_id)
    survivor = rig.worker("survivor")
    assert await survivor.step_window() == 0  # the lease (1 s) is still the dead worker's
    with caplog.at_level(logging.INFO, logger="spade.serving.lifecycle"):
        for _ in range(100):
            if await survivor.step_window():
                break
            await asyncio.sleep(0.05)
    (said,) = [r for r in caplog.records if r.name == "spade.serving.lifecycle"]  # whose slot, and why
    assert said.getMessage() == f"took over slot 0 of {env_id} from doomed: its lease lapsed unrenewed"
    assert (said.event, said.from_owner, said.reason) == ("took_over", "doomed", "lease lapsed")  # type: ignore[attr-defined]
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


class _Barrier(ScriptedPolicy):
    """A policy whose first ``waiting`` calls each wait until all of them are in flight at once."""

    waiting: int = 0
    arrived: int = 0
    all_in: asyncio.Event

    async def generate(self, input_ids: list[int], sampling: TurnSampling) -> Generation:
        if self.arrived < self.waiting:
            self.arrived += 1
            if self.arrived == self.waiting:
                self.all_in.set()
            await self.all_in.wait()
        return await super().generate(input_ids, sampling)


async def test_play_due_plays_every_due_env_at_once(rig: Rig) -> None:
    envs = [await rig.put_env(version=0, variant=str(i)) for i in range(3)]
    barrier = _Barrier(rig.template, ["\\boxed{0}"], weight_version=None)
    # Every first turn of all three envs' first slots (both arms) must be in flight together: one env
    # after another, the first env's plays would wait for the others' forever.
    barrier.waiting, barrier.all_in = 3 * 2 * G, asyncio.Event()
    worker = rig.worker("w1", barrier, max_concurrent_plays=3 * 2 * G, max_concurrent_envs=3)
    await worker.step_envs()
    assert await asyncio.wait_for(worker.play_due(), 30) == 3
    assert sorted((s.group_id, s.hinted) for s in await rig.samples()) == sorted(
        (f"{e}@s0", hinted) for e in envs for hinted in (False, True) for _ in range(G)
    )
    assert await worker.store.due_envs() == set()  # their next slots come with the next version
    await rig.publish_weights(7)  # slots 1 and 2 of every env are due, late: an env's slots one after another
    await worker.step_weights()
    assert await worker.store.due_envs() == set(envs)
    await drain(worker)
    later = await rig.samples()
    assert sorted({(s.group_id, s.window_index) for s in later}) == sorted(
        (f"{e}@s{i}", i) for e in envs for i in (1, 2)
    )
    assert len(later) == 3 * 2 * G and worker.counts.late_slots == 6
    worker.store.dispose()


class _SlowClaims(RolloutStateStore):
    """A state store whose claims, while slots are in flight, answer only after those slots ended (a slow
    query on a loaded machine): the claim skipped them as busy, and their envs' next slots are due now."""

    async def claim(self, owner: str, lease_s: float, busy: Collection[str] = ()) -> Claim | None:
        names = {f"slot {env_id}" for env_id in busy}
        while any(t.get_name().partition("#")[0] in names for t in asyncio.all_tasks()):
            await asyncio.sleep(0.01)
        await asyncio.sleep(0)  # the ended slots' done callbacks
        return await super().claim(owner, lease_s, busy)


async def test_play_due_plays_the_next_slot_of_an_env_whose_slot_ended_while_it_claimed(rig: Rig) -> None:
    env_id = await rig.put_env(version=0)
    worker = rig.worker("w1", max_concurrent_envs=2)
    worker.store.dispose()
    worker.store = _SlowClaims.from_url(rig.state_url)
    await worker.step_envs()
    assert await asyncio.wait_for(worker.play_due(), 60) == 1
    assert {s.group_id for s in await rig.samples()} == {f"{env_id}@s0"}
    await rig.publish_weights(7)  # slots 1 and 2 due: each ends while play_due claims beside it
    await worker.step_weights()
    assert await asyncio.wait_for(worker.play_due(), 60) == 2
    assert {s.group_id for s in await rig.samples()} == {f"{env_id}@s1", f"{env_id}@s2"}
    stored = await worker.store.get(env_id)
    assert stored is not None and stored.status is EnvStatus.RETIRED  # its window closed and was retired in the call
    worker.store.dispose()


async def test_play_due_bounded_by_max_concurrent_envs_and_skipping_what_it_is_told(rig: Rig) -> None:
    envs = [await rig.put_env(version=0, variant=str(i)) for i in range(4)]
    policy = _Barrier(rig.template, ["\\boxed{0}"], weight_version=None)
    policy.waiting, policy.all_in = 3 * 2 * G, asyncio.Event()  # three envs' plays at once: never
    worker = rig.worker("w1", policy, max_concurrent_plays=4 * 2 * G, max_concurrent_envs=2, lease_s=600)
    await worker.step_envs()
    task = asyncio.create_task(worker.play_due(skip={envs[3]}))
    for _ in range(600):
        if policy.arrived == 2 * 2 * G:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)
    # Two envs at once (of the three it may play), the skipped one never claimed.
    assert policy.arrived == 2 * 2 * G and not task.done()
    leases = [(await worker.store.lease(e))[0] for e in envs]
    assert leases.count("w1") == 2 and leases[3] is None, leases
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # Cancelled, it handed both leases back at once: another worker plays every slot now.
    assert [await worker.store.lease(e) for e in envs] == [(None, None)] * 4
    other = rig.worker("other", max_concurrent_plays=4 * 2 * G, lease_s=600)
    assert await other.play_due() == 4
    assert {s.group_id for s in await rig.samples()} == {f"{e}@s0" for e in envs}
    worker.store.dispose()
    other.store.dispose()


async def test_a_redelivered_env_is_registered_once_and_played_once(rig: Rig) -> None:
    env_id = await rig.put_env(version=0)
    worker = rig.worker("w1")
    await drain(worker)
    assert len(await rig.samples()) == 2 * G
    # The same env announced again (a designer retry): registered once, played once.
    again = queues_pb2.EnvReady(env_id=env_id, setting=types_pb2.SETTING_GAME, weight_version=0, spec_id=SPEC.spec_id)
    await publish_proto(rig.queue, ENVS_READY, again, key=f"{env_id}-again")
    await drain(worker)
    assert await rig.samples() == []
    worker.store.dispose()


async def test_envs_of_another_run_spec_or_missing_from_the_memory_are_refused_with_a_reason(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    foreign = await rig.put_env(version=0, spec_id="0123456789abcdef", variant="foreign")
    await publish_proto(
        rig.queue, ENVS_READY, queues_pb2.EnvReady(env_id="nope", setting=types_pb2.SETTING_GAME), key="nope"
    )
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
    # Faulted once (the first session on the seed: an audit play or a real one, they run side by
    # side), then both audit policies and both arms: every play counted once.
    assert [s for _, _, s in rig.sessions.opened].count(seeds[0]) == 1 + 2 + 2
    assert worker.counts.audit_plays == 2 * SPEC.audit_plays and worker.counts.plays == 2 * G
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
    # Slot 1 is held back for lease_s after its failure (by the database's clock; a loaded machine may
    # take longer to get there); then it is skipped with its reason, slot 2 played, the window closed.
    later: list[queues_pb2.AgentSample] = []
    for _ in range(100):
        await asyncio.sleep(0.1)
        await drain(worker)
        later += await rig.samples()
        if later:
            break
    assert {s.window_index for s in later} == {2}
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


@dataclass
class TargetOracle(ScriptedPolicy):
    """Reads CountdownEnv's target from the prompt and says it only when it is in ``wins`` (else 0)."""

    wins: frozenset[int] = frozenset()

    async def generate(self, input_ids: list[int], sampling: TurnSampling) -> Generation:
        text = self.template.decode(input_ids)
        target = int(text.rsplit("(it is ", 1)[1].split(")", 1)[0])
        self.replies = [f"\\boxed{{{target if target in self.wins else 0}}}"]
        self.calls.clear()
        return await super().generate(input_ids, sampling)


def _target(seed: int) -> int:
    return random.Random(seed).randint(1, 9)


async def _env_whose_extension_differs(rig: Rig) -> tuple[str, frozenset[int]]:
    """An env and a set of targets the first G seeds of slot 0 never show but the next G do."""
    for variant in range(50):
        env_id = await rig.put_env(variant=f"x{variant}", announce=False)
        seeds = play_seeds(env_id, 0, 2 * G)
        fresh = {_target(s) for s in seeds[G:]} - {_target(s) for s in seeds[:G]}
        if fresh:
            await rig.announce(env_id)
            return env_id, frozenset(fresh)
    raise AssertionError("no variant gave the extension a target of its own")


async def test_a_group_without_variance_is_extended_with_fresh_seeds_in_both_arms(rig: Rig) -> None:
    env_id, wins = await _env_whose_extension_differs(rig)
    policy = TargetOracle(rig.template, ["\\boxed{0}"], weight_version=None, wins=wins)
    worker = rig.worker("w1", policy, zero_variance_extensions=1)
    await drain(worker)
    samples = await rig.samples()
    seeds = play_seeds(env_id, 0, 2 * G)
    plain = sorted(s.seed for s in samples if not s.hinted)
    hinted = sorted(s.seed for s in samples if s.hinted)
    # The first G plays all lost (returns all 0): G fresh seeds of the same slot were played, both arms.
    assert plain == hinted == sorted(seeds)
    returns = {s.seed: s.episode_return for s in samples if not s.hinted}
    assert {returns[s] for s in seeds[:G]} == {0.0}
    assert len({returns[s] for s in seeds}) > 1  # the extended group carries signal
    assert {s.group_id for s in samples} == {f"{env_id}@s0"}  # one group, as the learner groups it
    assert worker.counts.extended_groups == 1
    stored = await rig.memory.get_environment(env_id)
    assert stored.stats.regret is not None  # both arms still on identical seeds
    worker.store.dispose()


async def test_extensions_stop_at_the_cap_and_off_means_never(rig: Rig) -> None:
    env_id = await rig.put_env()
    never = ScriptedPolicy(rig.template, ["\\boxed{0}"], weight_version=None)  # every play loses
    worker = rig.worker("w1", never, zero_variance_extensions=2)
    await drain(worker)
    samples = await rig.samples()
    assert sorted(s.seed for s in samples if not s.hinted) == sorted(play_seeds(env_id, 0, 3 * G))
    assert worker.counts.extended_groups == 2
    worker.store.dispose()

    other = await rig.put_env(variant="off")
    worker = rig.worker("w2", never, zero_variance_extensions=0)
    await drain(worker)
    samples = await rig.samples()
    assert {s.env_id for s in samples} == {other}
    assert len(samples) == 2 * G and worker.counts.extended_groups == 0
    worker.store.dispose()


async def test_an_audited_slot_extends_its_group_before_the_verdict_and_keeps_nothing_until_it(rig: Rig) -> None:
    """Slot 0's plays wait for the env's audit only to be kept: a group without signal is extended at
    once, while the audit still runs, and no play is published or recorded before the verdict."""
    env_id = await rig.put_env()
    never = ScriptedPolicy(rig.template, ["\\boxed{0}"], weight_version=None)  # every play loses: extended
    worker = rig.worker("w1", never, zero_variance_extensions=1)
    release = asyncio.Event()
    audit = worker.audit

    async def held_audit(*args: Any) -> Any:
        await release.wait()
        return await audit(*args)

    played: list[tuple[int, bool]] = []
    play = worker._runner.play

    async def counted(spec: Any, seed: int, **kwargs: Any) -> Any:
        done = await play(spec, seed, **kwargs)
        played.append((seed, kwargs["hinted"]))
        return done

    worker.audit = held_audit  # type: ignore[method-assign,assignment]
    worker._runner.play = counted  # type: ignore[method-assign,assignment]
    draining = asyncio.create_task(drain(worker))
    async with asyncio.timeout(30):
        while len(played) < 4 * G:  # both arms of the first group and of its extension
            await asyncio.sleep(0.01)
    assert worker.counts.extended_groups == 1
    assert worker.counts.plays == 0 and await rig.samples() == []
    assert (await rig.memory.plays(env_id))[0] == []
    release.set()
    await draining
    samples = await rig.samples()
    assert sorted(s.seed for s in samples if not s.hinted) == sorted(play_seeds(env_id, 0, 2 * G))
    assert worker.counts.plays == 4 * G
    worker.store.dispose()


async def test_a_group_with_variance_is_not_extended(rig: Rig) -> None:
    for variant in range(50):
        env_id = await rig.put_env(variant=f"v{variant}", announce=False)
        targets = [_target(s) for s in play_seeds(env_id, 0, G)]
        if len(set(targets)) > 1:
            await rig.announce(env_id)
            break
    policy = TargetOracle(rig.template, ["\\boxed{0}"], weight_version=None, wins=frozenset(targets[:1]))
    worker = rig.worker("w1", policy, zero_variance_extensions=3)
    await drain(worker)
    samples = await rig.samples()
    assert {s.env_id for s in samples} == {env_id}
    assert len(samples) == 2 * G and worker.counts.extended_groups == 0
    worker.store.dispose()


# ---- audit plays ------------------------------------------------------------------------------------


async def _put_class(rig: Rig, env_class: type, spec_id: str | None = None) -> str:
    """Store and announce a trusted test env class (played in-process by ``LocalSessions``)."""
    code = inspect.getsource(env_class)
    rig.sessions.classes[code] = env_class
    put = await rig.memory.put_environment(
        NewEnvironment(setting=Setting.GAME, skill="Optimization", code=code, hint="Read it.", designer_sample_id="d")
    )
    await rig.announce(put.env_id, spec_id=spec_id)
    return put.env_id


async def _audits(rig: Rig) -> list[queues_pb2.EnvAudit]:
    got = await rig.queue.consume(ENVS_AUDITED, "test-learner", "t", count=100, block_ms=20)
    return [m for m in (decode(d) for d in got) if isinstance(m, queues_pb2.EnvAudit)]


async def test_a_trivially_won_env_is_retired_and_none_of_its_real_plays_is_kept(rig: Rig) -> None:
    env_id = await _put_class(rig, ForgingEnv)
    policy = ScriptedPolicy(rig.template, ["\\boxed{0}"], weight_version=None)
    worker = rig.worker("w1", policy)
    await drain(worker)
    # Slot 0's real plays ran beside the audit (they set its pace), but none was kept after the verdict.
    assert await rig.samples() == [] and (await rig.memory.plays(env_id))[0] == []
    assert worker.counts.plays == 0
    n = SPEC.audit_plays
    assert (worker.counts.audit_plays, worker.counts.audit_retired) == (2 * n, 1)
    assert (await rig.memory.get_environment(env_id)).status is MemoryEnvStatus.TRIVIALLY_WON
    skipped = await worker.store.skipped(env_id)
    assert [s.slot for s in skipped] == list(range(K))
    won = f"retired as trivially_won: the noop policy returned 1.00 on average over its {n} audit plays"
    assert all(s.reason.startswith(won) for s in skipped)
    (audit,) = await _audits(rig)
    assert (audit.env_id, audit.trivially_won, audit.spec_id) == (env_id, True, SPEC.spec_id)
    assert [(p.policy, list(p.seeds), list(p.returns)) for p in audit.policies] == [
        (policy_name, sorted(play_seeds(env_id, 0, n)), [1.0] * n) for policy_name in ("noop", "random")
    ]
    worker.store.dispose()


async def test_audit_plays_run_once_per_env_on_its_real_seeds_and_are_never_published_or_recorded(
    rig: Rig,
) -> None:
    env_id = await _put_class(rig, VaultEnv)
    worker = rig.worker("w1", ScriptedPolicy(rig.template, ["\\boxed{0}"], weight_version=None))
    await drain(worker)
    for version in range(1, K):
        await rig.publish_weights(version)
        await drain(worker)
    samples = await rig.samples()
    real = {sample_id(env_id, 0, s, hinted=h) for s in play_seeds(env_id, 0, G) for h in (False, True)}
    real |= {sample_id(env_id, slot, s, hinted=False) for slot in range(1, K) for s in play_seeds(env_id, slot, G)}
    assert {s.sample_id for s in samples} == real and len(samples) == len(real)
    plays, _ = await rig.memory.plays(env_id)
    assert {p.trajectory_id for p in plays} == real
    # Audit plays of both policies (noop, random) on slot 0's first seeds, once for the whole window.
    opened = [s for _, _, s in rig.sessions.opened]
    n = SPEC.audit_plays
    assert worker.counts.audit_plays == 2 * n and len(opened) == len(real) + 2 * n
    assert opened.count(play_seeds(env_id, 0, 1)[0]) == 2 + 2  # both policies, then both arms
    (audit,) = await _audits(rig)
    assert not audit.trivially_won and audit.reason == ""
    assert (await rig.memory.get_environment(env_id)).status is MemoryEnvStatus.RETIRED
    worker.store.dispose()


async def test_a_resumed_slot_0_keeps_its_verdict_and_publishes_it_once(rig: Rig) -> None:
    env_id = await _put_class(rig, ForgingEnv)
    first = rig.worker("w1")
    await drain(first)
    again = rig.worker("w2")  # another worker (or a restart) reaching the env's slot 0 again
    env = await again.store.get(env_id)
    assert env is not None and env.window_start is not None
    spec = await MemoryServicePlays(rig.memory).get_environment(env_id)
    verdict = await again.audit(env, spec, SlotRef(env.window_start, 0, SPEC.spec_id))
    assert verdict == await first.store.audit(env_id) and verdict is not None and verdict.trivially_won
    assert again.counts.audit_plays == 0  # the stored verdict, no audit played twice
    assert len(await _audits(rig)) == 1  # the same key: one message
    first.store.dispose()
    again.store.dispose()


async def test_a_run_without_audits_plays_none_and_publishes_no_verdict(rig: Rig) -> None:
    unaudited = SPEC.model_copy(update={"audit_plays": 0})
    await _put_class(rig, ForgingEnv, unaudited.spec_id)
    worker = rig.worker("w1", spec=unaudited)
    await drain(worker)
    assert worker.counts.audit_plays == 0 and await _audits(rig) == []
    assert len(await rig.samples()) == 2 * G  # the forging env is played and trained on, unaudited
    worker.store.dispose()


async def test_the_verdict_published_is_the_one_stored_when_another_worker_stored_first(rig: Rig) -> None:
    """Two workers audit the same slot 0 at once: the one that stores second publishes the stored verdict,
    not its own, so the learner (first message per key) and the rollout can never hold different ones."""
    from services.rollout.core.audit import AuditVerdict
    from services.rollout.core.schedule import ActiveEnv

    env_id = await _put_class(rig, ForgingEnv)
    worker = rig.worker("w2", audit_paced=False)  # no real play runs beside this audit to set its pace
    theirs = AuditVerdict(env_id, (), SPEC.audit_max_win_rate, False, "")  # the other worker's, stored first
    assert await worker.store.record_audit(theirs) == theirs

    async def not_yet(_: str) -> AuditVerdict | None:
        return None  # this worker looked before the other one stored

    worker.store.audit = not_yet  # type: ignore[method-assign,assignment]
    env = ActiveEnv(env_id=env_id, setting="game", skill="Optimization", designer_sample_id="d", window=1,
                    design_version=0, spec_id=SPEC.spec_id)  # fmt: skip
    spec = await MemoryServicePlays(rig.memory).get_environment(env_id)
    verdict = await worker.audit(env, spec, SlotRef(0, 0, SPEC.spec_id))
    assert worker.counts.audit_plays > 0  # it played its own audit (the forging env: trivially won)
    assert verdict == theirs
    published = await _audits(rig)
    assert len(published) == 1 and not published[0].trivially_won
    worker.store.dispose()
