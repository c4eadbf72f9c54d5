"""Weight versions written, checkpointed and published in an order that never goes back.

A version to publish is written to ``weights_dir/v<N>``, then **checkpointed** (the checkpoint links
the same weight files), and only then published, so the published version never exceeds the
checkpointed one. ``VersionWriter`` does the first two on every rank (both are collective under
FSDP2); ``Versions`` (rank 0) decides which versions are published and checkpointed, publishes, and
on a restart finishes a publication that a crash interrupted: the checkpoint records the version
whose publication was pending, ``<checkpoint_dir>/published.json`` the last one completed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.learner.buffer import ANNOUNCED_FILE, read_announced
from services.learner.checkpoint import CheckpointManager, copy_weights, write_json_atomic, write_weights
from services.learner.latest import check_unpublished
from services.learner.publisher import PublishResult, WeightPublisher
from services.learner.settings import LearnerSettings
from services.learner.trainer import Trainer
from spade.inference.published import published_version
from spade.serving.logs import get_logger

logger = get_logger(__name__)


class ResumeError(RuntimeError):
    """The learner cannot start from what is on disk without going back in time (the message says how to fix it)."""


def check_checkpoint_spec(state: Mapping[str, Any], spec_id: str) -> None:
    """Refuse a checkpoint's state written under another run spec.

    Raises:
        ResumeError: The state names another spec (its pending windows and samples belong to it).
    """
    stored = state.get("spec_id")
    if stored is not None and stored != spec_id:
        raise ResumeError(
            f"the checkpoint was written under run spec {stored} but this run's spec is "
            f"{spec_id}; its pending windows and buffered samples belong to the other spec: restore "
            f"that spec, or start this spec's run with a fresh checkpoint_dir and weights_dir"
        )


def version_dir(weights_dir: Path, version: int) -> Path:
    """Where weight version ``version`` is published: ``weights_dir/v<8 digits>``."""
    return weights_dir / f"v{version:08d}"


@dataclass
class Written:
    """What ``VersionWriter.write`` wrote on this rank (paths only on rank 0).

    Attributes:
        weights: The weight directory of the version to publish.
        checkpoint: The checkpoint directory.
        timings: Seconds of ``weights`` and ``checkpoint`` (those that ran).
    """

    weights: Path | None = None
    checkpoint: Path | None = None
    timings: dict[str, float] = field(default_factory=dict)


class VersionWriter:
    """Writes a version's weights and checkpoints it, on every rank (the writes are collective under FSDP2).

    Args:
        trainer: The trainer whose model and optimizer are written.
        checkpoints: The checkpoint manager.
        weights_dir: The published versions' root.
        base_model_dir: Tokenizer files are linked from here into each written version.
    """

    def __init__(
        self, trainer: Trainer, checkpoints: CheckpointManager, weights_dir: Path, base_model_dir: Path | None
    ) -> None:
        self.trainer = trainer
        self.checkpoints = checkpoints
        self.weights_dir = weights_dir
        self.base_model_dir = base_model_dir

    def write(self, publish_version: int | None, checkpoint_step: int | None, state: dict[str, Any]) -> Written:
        """Write the weights of ``publish_version``, then the checkpoint ``checkpoint_step`` with ``state``.

        In this order, so a version is checkpointed before anyone publishes it; the checkpoint of the
        version just written links its weight files (the same bytes, not written twice).
        """
        out = Written()
        model, world = self.trainer.model, self.trainer.world
        written = None
        if publish_version is not None:
            clock = time.perf_counter()
            written = version_dir(self.weights_dir, publish_version)
            out.weights = write_weights(model, written, base_model_dir=self.base_model_dir, world=world)
            out.timings["weights"] = time.perf_counter() - clock
        if checkpoint_step is not None:
            clock = time.perf_counter()
            same = written if checkpoint_step == publish_version else None
            optimizer = self.trainer.optimizer
            out.checkpoint = self.checkpoints.save(checkpoint_step, model, optimizer, state, model_files=same)
            out.timings["checkpoint"] = time.perf_counter() - clock
        return out


class Versions:
    """Rank 0's weight versions: which to publish and checkpoint, the publication, the one a crash cut short.

    Args:
        settings: Learner settings (``publish_every``, ``checkpoint_every``, the directories).
        checkpoints: The checkpoint manager (an interrupted publication is finished from its files).
        publisher: The weight publisher (``None``: versions are written and checkpointed, never published).
    """

    def __init__(
        self, settings: LearnerSettings, checkpoints: CheckpointManager, publisher: WeightPublisher | None
    ) -> None:
        self.settings = settings
        self.checkpoints = checkpoints
        self.publisher = publisher
        self.checkpointed: int | None = None
        """The version of the newest checkpoint written or resumed from (``None``: none yet)."""
        self.pending: int | None = None
        """A version checkpointed but not published before a crash (finished by ``finish_pending``)."""

    def check_not_behind(self, version: int) -> None:
        """Refuse to start at ``version`` when ``weights_dir/latest`` is ahead of it.

        Raises:
            ResumeError: A newer version was published from ``weights_dir``.
        """
        published = published_version(self.settings.weights_dir)
        if published > version:
            raise ResumeError(
                f"{self.settings.weights_dir}/latest points at published version {published} but the learner's "
                f"newest checkpoint is at version {version} (in {self.settings.checkpoint_dir}); starting "
                "here would serve older weights under newer version numbers. Restore the checkpoint directory "
                "of that run, or start a new run with a fresh weights_dir"
            )

    def resume_pending(self, pending: int | None, version: int) -> None:
        """Restored at ``version``: its publication is pending if the checkpoint says so and it is unannounced."""
        if pending is not None and int(pending) == version and read_announced(self.settings.checkpoint_dir) < version:
            self.pending = version

    def milestones(self, version: int) -> tuple[int | None, int | None]:
        """``(publish_version, checkpoint_step)`` of a step that trained ``version`` (``None``: not this step).

        A version to publish is always checkpointed; others every ``checkpoint_every`` versions.

        Raises:
            AlreadyPublished: ``version`` was already published (checked before anything is written).
        """
        publish = version if version % self.settings.publish_every == 0 else None
        if publish is not None:
            check_unpublished(self.settings.weights_dir, publish)
        checkpoint = version if publish is not None or version % self.settings.checkpoint_every == 0 else None
        return publish, checkpoint

    async def publish(self, version: int, weights: Path, *, resuming: bool = False) -> PublishResult | None:
        """Publish a written and checkpointed version, then record it as announced (``None``: no publisher)."""
        if self.publisher is None:
            return None
        result = await self.publisher.publish(version, weights, resuming=resuming)
        write_json_atomic(self.settings.checkpoint_dir / ANNOUNCED_FILE, {"version": version})
        return result

    async def finish_pending(self) -> None:
        """Publish the version whose publication a crash cut short (weights copied from its checkpoint if gone)."""
        version = self.pending
        if version is None or self.publisher is None:
            return
        target = version_dir(self.settings.weights_dir, version)
        if not (target / "config.json").is_file():
            await asyncio.to_thread(copy_weights, self.checkpoints.path(version) / "model", target)
        logger.warning("finishing the publication of weight version %d, interrupted before the restart", version)
        await self.publish(version, target, resuming=True)
        self.pending = None
