"""Published versions only go forward: a restart never serves older weights under a newer number."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.learner.latest import AlreadyPublished, point_latest
from services.learner.learner import ResumeError
from services.learner.publisher import WeightPublisher
from services.learner.wiring import close_learner
from spade.queues.base import WEIGHTS_PUBLISHED
from spade.queues.inprocess import InProcessQueue
from spade.v1 import queues_pb2

from .conftest import learner_for, make_settings
from .test_learner_loop import put_group


async def test_a_learner_behind_the_published_version_refuses_to_start(tmp_path, base_model, inprocess_queue):
    settings = make_settings(tmp_path, base_model)
    (settings.weights_dir / "v00000004").mkdir(parents=True)
    point_latest(settings.weights_dir, settings.weights_dir / "v00000004")  # another run's weights
    with pytest.raises(
        ResumeError, match="points at published version 4 but the learner's newest checkpoint is at version 0"
    ):
        learner_for(settings, inprocess_queue)
    with pytest.raises(ResumeError, match="published version 4"):
        learner_for(make_settings(tmp_path, base_model, resume=False), inprocess_queue)


async def test_a_version_published_meanwhile_is_never_overwritten(tmp_path, base_model, inprocess_queue):
    settings = make_settings(tmp_path, base_model)
    learner = learner_for(settings, inprocess_queue)
    (settings.weights_dir / "v00000001").mkdir(parents=True)
    (settings.weights_dir / "v00000001" / "marker").write_text("someone else's v1")
    point_latest(settings.weights_dir, settings.weights_dir / "v00000001")
    await put_group(inprocess_queue, "e1", 0, [1, 0, 0, 1])
    with pytest.raises(AlreadyPublished, match="weight version 1 cannot be published"):
        await learner.run_step()
    assert (settings.weights_dir / "v00000001" / "marker").read_text() == "someone else's v1"
    await close_learner(learner, close_queue=False)


class CrashingPublisher(WeightPublisher):
    """Dies (as the process would) after the checkpoint, before any worker hears of the version."""

    async def publish(self, version, path, *, resuming=False):
        raise SystemExit("killed between the checkpoint and the publication")


async def test_a_publication_cut_short_by_a_crash_is_finished_on_restart(tmp_path, base_model):
    queue = InProcessQueue()
    settings = make_settings(tmp_path, base_model)
    learner = learner_for(settings, queue)
    assert learner.publisher is not None
    learner.publisher.__class__ = CrashingPublisher
    await put_group(queue, "e1", 0, [1, 0, 0, 1])
    with pytest.raises(SystemExit):
        await learner.run_step()
    # Version 1 is checkpointed (with its publication pending) but was never announced.
    assert learner.checkpoints.steps() == [1]
    assert not (settings.checkpoint_dir / "published.json").exists()
    assert await queue.consume(WEIGHTS_PUBLISHED, "watcher", "w", block_ms=10) == []

    restarted = learner_for(settings, queue)
    assert restarted.version == 1
    await put_group(queue, "e2", 1, [0, 1, 1, 0])
    report = await restarted.run_step()  # first finishes v1's publication, then trains and publishes v2
    assert report.publish is not None and report.publish.version == 2
    announced = await queue.consume(WEIGHTS_PUBLISHED, "watcher", "w", count=10, block_ms=10)
    assert [queues_pb2.WeightsPublished.FromString(d.payload).weight_version for d in announced] == [1, 2]
    assert json.loads((settings.checkpoint_dir / "published.json").read_text()) == {"version": 2}
    assert Path(settings.weights_dir / "latest").resolve().name == "v00000002"
    await close_learner(restarted, close_queue=False)
    await queue.close()
