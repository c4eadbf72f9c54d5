"""The learner loop end to end on a tiny model and the real queues (in-process and Redis)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from services.learner.core.window import ScoredAttempt, ScoreOutcome
from services.learner.learner import Learner
from services.learner.wiring import close_learner
from spade.queues.base import SAMPLES_AGENT, SAMPLES_DESIGNER, WEIGHTS_PUBLISHED, WorkQueue
from spade.signal import group_zscores
from spade.v1 import queues_pb2

from .conftest import SPEC, agent_sample, designer_sample, learner_for, make_settings


async def put(queue: WorkQueue, stream: str, msg) -> None:
    await queue.publish(stream, msg.SerializeToString(), key=msg.sample_id)


async def put_group(queue: WorkQueue, env: str, version: int, returns: list[float], hinted: bool = False) -> None:
    arm = "h" if hinted else "u"
    for seed, r in enumerate(returns):
        await put(queue, SAMPLES_AGENT, agent_sample(f"{env}-v{version}-{arm}{seed}", env, seed, r, version, hinted))


async def phase_one(queue: WorkQueue, designers: bool = True) -> None:
    """Two envs of one batch and skill, designed at version 0, played with and without the hint."""
    if designers:
        await put(queue, SAMPLES_DESIGNER, designer_sample("d1", "e1"))
        await put(queue, SAMPLES_DESIGNER, designer_sample("d2", "e2"))
        await put(queue, SAMPLES_DESIGNER, designer_sample("d3", "", valid=False))
    await put_group(queue, "e1", 0, [1, 0, 0, 0])
    await put_group(queue, "e1", 0, [1, 1, 1, 0], hinted=True)
    await put_group(queue, "e2", 0, [1, 1, 1, 0])
    await put_group(queue, "e2", 0, [1, 1, 1, 1], hinted=True)


async def phase_two(queue: WorkQueue) -> None:
    """The envs' second window version: fresh seeds, unhinted only."""
    await put_group(queue, "e1", 1, [1, 1, 0, 0])
    await put_group(queue, "e2", 1, [1, 1, 1, 1])  # zero variance: dropped


def params(learner: Learner) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in learner.trainer.model.named_parameters()}


async def test_three_steps_train_score_the_designer_publish_and_checkpoint(tmp_path, base_model, inprocess_queue):
    scored: list[ScoredAttempt] = []
    settings = make_settings(tmp_path, base_model, keep_checkpoints=2)
    learner = learner_for(settings, inprocess_queue, on_designer_reward=scored.append)
    start = params(learner)
    await phase_one(inprocess_queue)
    r1 = await learner.run_step()
    await phase_two(inprocess_queue)
    r2 = await learner.run_step()
    r3 = await learner.run_step()

    assert [r.version for r in (r1, r2, r3)] == [1, 2, 3] and all(r.trained for r in (r1, r2, r3))
    assert all(not torch.equal(p, start[n]) for n, p in params(learner).items())

    # The designer round is scored as soon as both windows are complete (slot 1 arrived before step 2).
    assert r1.designer_rewards == [] and r2.designer_rewards == scored and len(scored) == 3
    by_id = {s.attempt.sample_id: s for s in scored}
    assert by_id["d3"].outcome is ScoreOutcome.INVALID
    e1, e2 = by_id["d1"].components, by_id["d2"].components
    assert e1 is not None and e2 is not None
    assert (e1.regret, e2.regret) == pytest.approx((0.5, 0.25))
    assert (e1.window_win_rate, e2.window_win_rate) == pytest.approx((3 / 8, 7 / 8))
    assert (e1.blend, e2.blend) == pytest.approx((0.4 + 0.6 * 0.9, 0.4))
    # One round, one skill of three scored envs: centred on their mean, every advantage nonzero.
    mean = (0.94 + 0.4 + 0.0) / 3
    flat = r2.flat_metrics()
    assert flat["designer/advantage_nonzero_frac"] == 1.0
    assert flat["designer/advantage_abs_mean"] == pytest.approx((abs(0.94 - mean) + abs(0.4 - mean) + mean) / 3)
    z = group_zscores([1.0, 1.0, 1.0, 0.0]) or []
    assert flat["agent/advantage_abs_mean"] == pytest.approx(sum(abs(v) for v in z) / 4)  # before role scaling
    assert r2.counters["designer_rounds"] == 1 and r2.counters["designer_trained"] == 3
    assert r2.counters["designer_scored"] == 2 and r2.counters["designer_invalid"] == 1
    assert learner.totals["agent_groups_zero_variance"] == 1  # e2's slot 1
    assert r2.metrics is not None and r2.metrics.samples == 4 + 3  # e2's slot 0 plus three designer samples
    assert flat["designer/blend_mean"] == pytest.approx((0.94 + 0.4 + 0.0) / 3)
    assert learner.baselines.mean("Mathematical Reasoning") == pytest.approx(mean)

    # Staleness: versions between the weights that produced a trained sample and the learner's.
    assert r1.flat_metrics()["staleness/agent_max"] == 0.0  # version 0's plays trained at version 0
    assert r2.staleness == {  # e2's slot 0 waited a step; the designer samples of version 0
        "staleness/agent_mean": 1.0,
        "staleness/agent_max": 1.0,
        "staleness/designer_mean": 1.0,
        "staleness/designer_max": 1.0,
    }
    assert r3.staleness == {"staleness/agent_mean": 1.0, "staleness/agent_max": 1.0}  # e1's slot 1 at version 2

    # Where each step's time went, part after part; the log line and the metrics carry them.
    assert r3.publish is not None and r3.checkpoint is not None and r3.metrics is not None
    assert set(r3.timings) == {"wait", "assemble", "train", "weights", "checkpoint", "publish"}
    assert all(seconds >= 0 for seconds in r3.timings.values())
    assert r3.timings["train"] >= r3.metrics.step_time_s  # the trainer's own clock runs inside it
    assert r3.flat_metrics()["time/checkpoint_s"] == round(r3.timings["checkpoint"], 4)

    # Weights: version 3 on disk as a HF checkpoint with the tokenizer files; announced on the queue.
    v3 = settings.weights_dir / "v00000003"
    assert (v3 / "config.json").is_file() and (v3 / "tokenizer_config.json").is_file()
    saved = load_file(str(v3 / "model.safetensors"))
    live = learner.trainer.model.state_dict()
    assert all(torch.equal(saved[k], live[k]) for k in saved)
    # Its checkpoint holds the same weight files, linked, not written twice.
    linked = learner.checkpoints.path(3) / "model" / "model.safetensors"
    assert linked.stat().st_ino == (v3 / "model.safetensors").stat().st_ino
    announced = await inprocess_queue.consume(WEIGHTS_PUBLISHED, "watcher", "w", count=10, block_ms=10)
    published = [queues_pb2.WeightsPublished.FromString(d.payload) for d in announced]
    assert [m.weight_version for m in published] == [1, 2, 3]
    assert {m.spec_id for m in published} == {SPEC.spec_id}

    # Checkpoints: every published version is checkpointed; retention kept the newest two. Every
    # message consumed was acknowledged at once (it is durable in the journal), none re-delivered.
    assert learner.checkpoints.steps() == [2, 3]
    assert await inprocess_queue.pending(SAMPLES_AGENT, "learner") == 0
    assert learner.totals["duplicates"] == 0 and learner.totals["redelivered"] == 0
    state = json.loads((settings.checkpoint_dir / "learner_state.json").read_text())
    assert state["version"] == 3 and state["window"]["pending"] == [] and state["spec_id"] == SPEC.spec_id
    assert json.loads((settings.checkpoint_dir / "published.json").read_text()) == {"version": 3}
    await close_learner(learner, close_queue=False)


async def test_stale_groups_are_dropped_and_counted(tmp_path, base_model, inprocess_queue):
    learner = learner_for(make_settings(tmp_path, base_model, max_staleness=0), inprocess_queue)
    await put_group(inprocess_queue, "e1", 0, [1, 0, 0, 1])
    await learner.run_step()  # trains version 0's group: version 1
    await put_group(inprocess_queue, "e9", 0, [1, 0, 1, 0])  # arrives late: version 0 < 1 - 0
    await put_group(inprocess_queue, "e2", 1, [0, 1, 1, 0])
    report = await learner.run_step()
    assert report.counters["stale_dropped"] == 4 and report.counters["stale_groups_dropped"] == 1
    assert report.trained and report.metrics is not None and report.metrics.samples == 4
    await close_learner(learner, close_queue=False)


async def test_duplicates_and_malformed_messages_are_counted_not_trained(tmp_path, base_model, inprocess_queue):
    learner = learner_for(make_settings(tmp_path, base_model), inprocess_queue)
    await put_group(inprocess_queue, "e1", 0, [1, 0, 0, 1])
    dup = agent_sample("e1-v0-u0", "e1", 0, 1.0)
    await inprocess_queue.publish(SAMPLES_AGENT, dup.SerializeToString(), key="another-key")
    bad = agent_sample("bad", "e1", 5, 1.0)
    del bad.loss_mask[-2:]
    await inprocess_queue.publish(SAMPLES_AGENT, bad.SerializeToString(), key="bad")
    await inprocess_queue.publish(SAMPLES_AGENT, b"\xff\xffnot a protobuf", key="garbage")
    report = await learner.run_step()
    assert report.counters["duplicates"] == 1 and report.counters["malformed"] == 2
    assert report.metrics is not None and report.metrics.samples == 4
    assert await inprocess_queue.pending(SAMPLES_AGENT, "learner") == 0  # poison messages never block
    await close_learner(learner, close_queue=False)


async def test_nothing_ready_means_no_step_and_no_new_version(tmp_path, base_model, inprocess_queue):
    learner = learner_for(make_settings(tmp_path, base_model), inprocess_queue)
    await put_group(inprocess_queue, "e1", 0, [0.5, 0.5, 0.5, 0.5])  # complete but zero variance
    report = await learner.run_step()
    assert not report.trained and report.version == 0 and report.metrics is None
    assert report.counters["agent_groups_zero_variance"] == 1
    assert not (tmp_path / "weights").exists()
    await close_learner(learner, close_queue=False)


async def _run(tmp_path: Path, base: Path, queue: WorkQueue, crash_after_two: bool):
    """Three steps with checkpoints every 2; optionally crash after step 3 and redo it after a resume."""
    settings = make_settings(tmp_path, base, checkpoint_every=2, publish_every=100)
    learner = learner_for(settings, queue)
    await phase_one(queue)
    await learner.run_step()
    await learner.run_step()  # checkpoint at version 2
    await phase_two(queue)
    r3 = await learner.run_step()  # consumes phase two: in the journal, acknowledged, not checkpointed
    if crash_after_two:
        assert await queue.pending(SAMPLES_AGENT, "learner") == 0
        assert learner.journal is not None
        learner.journal.close()
        await close_learner(learner, close_queue=False)  # the process dies here: no checkpoint of version 3
        learner = learner_for(settings, queue)
        # The checkpoint of version 2 plus the journal since: phase two is back without the queue.
        assert learner.version == 2 and set(learner.window.pending) == {"d1", "d2", "d3"}
        assert learner.totals["agent_received"] == 16 + 8  # phase one's 16 plays and phase two's 8
        r3 = await learner.run_step()
        assert r3.trained and r3.counters.get("redelivered", 0) == 0 and r3.counters.get("duplicates", 0) == 0
    out = params(learner), r3
    await close_learner(learner, close_queue=False)
    return out


@pytest.mark.slow
async def test_resume_after_a_crash_gives_the_same_next_step(tmp_path, base_model, redis_queue):
    from spade.queues.config import RedisQueueConfig
    from spade.queues.redis_streams import RedisStreamQueue

    other = RedisStreamQueue(
        RedisQueueConfig(url=redis_queue._config.url, prefix=redis_queue._config.prefix + "b:", claim_idle_ms=200)
    )
    try:
        (p_straight, r_straight) = await _run(tmp_path / "a", base_model, redis_queue, crash_after_two=False)
        (p_resumed, r_resumed) = await _run(tmp_path / "b", base_model, other, crash_after_two=True)
    finally:
        await other.delete_all()
        await other.close()
    assert r_resumed.version == r_straight.version == 3
    assert [s.components for s in r_resumed.designer_rewards] == [s.components for s in r_straight.designer_rewards]
    assert r_resumed.metrics is not None and r_straight.metrics is not None
    assert r_resumed.metrics.loss == r_straight.metrics.loss
    for name, p in p_straight.items():
        assert torch.equal(p, p_resumed[name]), name


async def test_samples_of_another_run_spec_are_refused_acknowledged_and_counted(tmp_path, base_model, inprocess_queue):
    learner = learner_for(make_settings(tmp_path, base_model), inprocess_queue)
    for seed, r in enumerate([1, 0, 0, 1]):
        foreign = agent_sample(f"x{seed}", "e1", seed, r, spec_id="another-spec")
        await inprocess_queue.publish(SAMPLES_AGENT, foreign.SerializeToString(), key=foreign.sample_id)
    legacy = designer_sample("dx", "e1", spec_id="")  # a producer that names no spec is refused too
    await inprocess_queue.publish(SAMPLES_DESIGNER, legacy.SerializeToString(), key="dx")
    report = await learner.run_step()
    assert not report.trained and report.counters["refused_spec"] == 5
    assert "agent_received" not in report.counters and learner.groups == {} and learner.window.pending == {}
    assert await inprocess_queue.pending(SAMPLES_AGENT, "learner") == 0  # acknowledged: never re-delivered
    await close_learner(learner, close_queue=False)


async def test_resource_faults_are_counted_per_reason_and_not_trained_by_default(tmp_path, base_model, inprocess_queue):
    for policy, trained_plays in (("drop", 3), ("zero", 4)):
        learner = learner_for(
            make_settings(tmp_path / policy, base_model, resource_fault_policy=policy), inprocess_queue
        )
        env = f"bomb-{policy}"
        for seed, (r, finish) in enumerate(
            [(1, "terminated"), (0, "truncated"), (1, "terminated"), (0, "fault_memory")]
        ):
            msg = agent_sample(f"{env}-{seed}", env, seed, r, finish=finish)
            await inprocess_queue.publish(SAMPLES_AGENT, msg.SerializeToString(), key=msg.sample_id)
        report = await learner.run_step()
        assert report.trained and report.metrics is not None and report.metrics.samples == trained_plays
        assert report.counters["resource_fault/fault_memory"] == 1
        assert report.counters[f"resource_fault_{'dropped' if policy == 'drop' else 'zeroed'}"] == 1
        assert report.flat_metrics()["count/resource_fault/fault_memory"] == 1.0
        await close_learner(learner, close_queue=False)


async def test_untrainable_designer_samples_are_scored_but_never_trained(tmp_path, base_model, inprocess_queue):
    scored: list[ScoredAttempt] = []
    learner = learner_for(make_settings(tmp_path, base_model), inprocess_queue, on_designer_reward=scored.append)
    for sid, env in (("p1", "e1"), ("p2", "e2")):
        msg = designer_sample(sid, env, trainable=False)
        await inprocess_queue.publish(SAMPLES_DESIGNER, msg.SerializeToString(), key=sid)
    await phase_one(inprocess_queue, designers=False)
    await learner.run_step()
    await phase_two(inprocess_queue)
    report = await learner.run_step()
    assert {s.attempt.sample_id for s in scored} == {"p1", "p2"} and report.counters["designer_untrainable"] == 2
    assert report.counters["designer_trained"] == 0 and report.flat_metrics()["designer/advantage_nonzero_frac"] == 1
    assert report.metrics is not None and report.metrics.samples == 4  # one agent group, no designer sample
    await close_learner(learner, close_queue=False)


async def test_redelivery_happens_only_after_a_crash(tmp_path, base_model, redis_queue):
    """Steps far slower than the queue's claim interval (200 ms) re-deliver nothing: every message is
    acknowledged once it is in the journal. Messages a crashed learner had taken but not journaled come
    back, counted as re-delivered — and trained once, not as duplicates."""
    settings = make_settings(tmp_path, base_model, fill_timeout_s=1.0)
    learner = learner_for(settings, redis_queue)
    for step in range(3):
        await put_group(redis_queue, f"e{step}", 0, [1, 0, 0, 1])
        await put_group(redis_queue, f"e{step}", 0, [1, 1, 0, 1], hinted=True)
        report = await learner.run_step()
        await asyncio.sleep(0.5)  # longer than the claim interval
        assert report.trained
    assert learner.totals["redelivered"] == 0 and learner.totals["duplicates"] == 0
    await close_learner(learner, close_queue=False)

    # A learner that took four messages and died before they reached its journal.
    await put_group(redis_queue, "lost", 0, [0, 1, 1, 0])
    taken = await redis_queue.consume(SAMPLES_AGENT, "learner", settings.consumer_name, count=10, block_ms=100)
    assert len(taken) == 4
    learner = learner_for(settings, redis_queue)
    await asyncio.sleep(0.3)  # past the claim interval: Redis gives them back
    report = await learner.run_step()
    assert report.trained and report.counters["redelivered"] == 4 and report.counters.get("duplicates", 0) == 0
    assert report.metrics is not None and report.metrics.samples == 4
    await close_learner(learner, close_queue=False)
