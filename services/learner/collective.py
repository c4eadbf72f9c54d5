"""The part of a step every rank runs identically, and the follower ranks that only run that part.

Under ``torchrun`` rank 0 (``Learner``) decides each step and broadcasts a ``StepWork``; every rank,
rank 0 included, then runs ``execute``: the optimiser step, the weights of the version to publish,
the checkpoint — each collective under FSDP2. The other ranks are ``Follower``s: they hold no queue,
journal or publisher, receive the work and join the collectives until rank 0 says stop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.learner.core.batching import TrainSample
from services.learner.trainer import StepMetrics, Trainer
from services.learner.versions import VersionWriter, check_checkpoint_spec
from spade import openmp
from spade.serving.logs import get_logger

logger = get_logger(__name__)


@dataclass
class StepWork:
    """What every rank does this step (broadcast by rank 0 under torchrun).

    Attributes:
        batch: The samples to train on (empty: no optimiser step).
        publish_version: The version whose weights are written for publication, if any.
        checkpoint_step: The version checkpointed, if any.
        state: The learner's state stored with the checkpoint.
        stop: Rank 0 stops: the followers return.
    """

    batch: list[TrainSample]
    publish_version: int | None
    checkpoint_step: int | None
    state: dict[str, Any]
    stop: bool = False


@dataclass
class Executed:
    """What ``execute`` did on this rank (paths only on rank 0).

    Attributes:
        metrics: The trainer's metrics (``None`` when the batch was empty).
        weights: The written weights of the version to publish.
        checkpoint: The checkpoint written.
        timings: Seconds of ``train``, ``weights`` and ``checkpoint`` (those that ran).
    """

    metrics: StepMetrics | None = None
    weights: Path | None = None
    checkpoint: Path | None = None
    timings: dict[str, float] = field(default_factory=dict)


def execute(work: StepWork, trainer: Trainer, writer: VersionWriter) -> Executed:
    """Train on the work's batch, then write and checkpoint the new version (``VersionWriter.write``).

    Rank 0 publishes only after this returns, so the published version never exceeds the
    checkpointed one.
    """
    out = Executed()
    try:
        if work.batch:
            clock = time.perf_counter()
            out.metrics = trainer.train_step(work.batch)
            out.timings["train"] = time.perf_counter() - clock
        written = writer.write(work.publish_version, work.checkpoint_step, work.state)
    finally:
        openmp.release_threads()  # this executor thread idles until the next step (spade.openmp)
    out.weights, out.checkpoint = written.weights, written.checkpoint
    out.timings.update(written.timings)
    return out


class Follower:
    """A non-main rank under torchrun: restores the checkpoint, then joins every step's collectives.

    Args:
        spec_id: The run spec's id (a checkpoint of another spec is refused, as on rank 0).
        trainer: The sharded trainer.
        writer: Writes versions and checkpoints with rank 0.
    """

    def __init__(self, spec_id: str, trainer: Trainer, writer: VersionWriter) -> None:
        self.spec_id = spec_id
        self.trainer = trainer
        self.world = trainer.world
        self.writer = writer
        self.version = 0

    def resume(self) -> int | None:
        """Restore the newest checkpoint (as rank 0 does); returns its step or ``None``.

        Raises:
            ResumeError: The checkpoint belongs to another run spec.
        """
        restored = self.writer.checkpoints.load(self.trainer.model, self.trainer.optimizer)
        if restored is None:
            return None
        check_checkpoint_spec(restored.state, self.spec_id)
        self.version = int(restored.state["version"])
        logger.info("resumed from %s at weight version %d", restored.path, self.version)
        return restored.step

    def follow(self) -> None:
        """Join every step's collectives until rank 0 stops."""
        while True:
            work: StepWork = self.world.broadcast_object(None)
            if work.stop:
                return
            execute(work, self.trainer, self.writer)
            if work.batch:
                self.version += 1
