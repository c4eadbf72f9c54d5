"""The learner loop: consume samples, score designers, train, publish, checkpoint.

One ``run_step`` call:

1. drains ``samples.agent`` and ``samples.designer`` into the state: every play goes into its env's
   accumulator (for regret and the window win rate) and, unless hinted, into its advantage group;
   every designer sample waits in the window;
2. stops when ``agent_groups_per_step`` groups are complete or ``fill_timeout_s`` has passed;
3. scores the designer samples whose window closed, drops stale and zero-variance groups, assigns
   advantages (z-scores per group, per-skill centred blends, per-role scaling);
4. trains one step (``Trainer.train_step`` in a worker thread), so the weight version becomes N+1;
5. every ``publish_every`` steps writes version N and publishes it; every ``checkpoint_every``
   steps writes a checkpoint and only then acknowledges the queue messages received so far.

Acknowledging at checkpoints means a crash replays exactly the messages received since the last
checkpoint into the state restored from it: nothing is lost and nothing is counted twice (sample
ids are deduplicated, so re-deliveries of held messages are ignored).

Under ``torchrun`` every rank runs the same loop; rank 0 alone reads the queue, talks HTTP and
writes files, and broadcasts each step's plan to the other ranks, which join the collectives.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from google.protobuf.message import DecodeError

from services.learner.checkpoint import CheckpointManager, write_json_atomic, write_weights
from services.learner.core.batching import (
    AgentPlaySample,
    BatchError,
    TrainSample,
    agent_advantages,
    designer_advantages,
    normalize_per_role,
    staleness,
)
from services.learner.core.rewards import DesignerRewardConfig, group_zscores
from services.learner.core.window import DesignerWindow, ScoredAttempt, ScoreOutcome
from services.learner.publisher import PublishResult, WeightPublisher
from services.learner.samples import (
    agent_play,
    agent_train_sample,
    designer_attempt,
    play_sample_from_json,
    play_sample_to_json,
)
from services.learner.settings import LearnerSettings
from services.learner.trainer import StepMetrics, Trainer
from spade.queues.base import SAMPLES_AGENT, SAMPLES_DESIGNER, Delivery, WorkQueue
from spade.v1 import queues_pb2

logger = logging.getLogger(__name__)

RewardCallback = Callable[[ScoredAttempt], None]
"""Receives every designer attempt whose window closed (e.g. to store its components in the memory)."""


@dataclass
class StepReport:
    """What one ``run_step`` did.

    Attributes:
        version: The learner's weight version after the step.
        trained: Whether an optimiser step happened (False when nothing trainable was ready).
        metrics: The trainer's metrics (``None`` when not trained).
        counters: Counts of this step (samples, groups kept/dropped, stale, duplicates, ...).
        designer_rewards: The designer attempts scored in this step.
        publish: The weight publication, when this step published.
        checkpoint: The checkpoint written by this step, if any.
        staleness: Versions behind the learner of the trained samples' weights, per role (mean, max).
    """

    version: int
    trained: bool
    metrics: StepMetrics | None
    counters: dict[str, int]
    designer_rewards: list[ScoredAttempt] = field(default_factory=list)
    publish: PublishResult | None = None
    checkpoint: Path | None = None
    staleness: dict[str, float] = field(default_factory=dict)

    def flat_metrics(self) -> dict[str, float]:
        """Every figure of the step under one flat namespace (for logs and dashboards)."""
        out: dict[str, float] = {"version": float(self.version)}
        if self.metrics is not None:
            out.update(self.metrics.as_dict())
        out.update({f"count/{k}": float(v) for k, v in self.counters.items()})
        out.update(self.staleness)
        scored = [s.components for s in self.designer_rewards if s.components is not None]
        for name in ("regret", "regret_norm", "window_win_rate", "plateau", "blend"):
            values = [getattr(c, name) for c in scored if getattr(c, name) is not None]
            if values:
                out[f"designer/{name}_mean"] = sum(values) / len(values)
        return out


@dataclass
class _Plan:
    """What every rank does this step (broadcast by rank 0 under torchrun)."""

    batch: list[TrainSample]
    publish_version: int | None
    checkpoint_step: int | None
    state: dict[str, Any]
    stop: bool = False


class Learner:
    """The learner service's loop (see the module docstring).

    Args:
        settings: Learner settings.
        queue: The work queue (``None`` on non-main ranks).
        trainer: The torch trainer.
        checkpoints: Checkpoint manager.
        publisher: Weight publisher (``None`` on non-main ranks, or to skip publishing).
        base_model_dir: Tokenizer files are copied from here into each published version.
        on_designer_reward: Optional callback for every scored designer attempt.
    """

    def __init__(
        self,
        settings: LearnerSettings,
        queue: WorkQueue | None,
        trainer: Trainer,
        checkpoints: CheckpointManager,
        publisher: WeightPublisher | None,
        *,
        base_model_dir: Path | None = None,
        on_designer_reward: RewardCallback | None = None,
    ) -> None:
        self.settings = settings
        self.queue = queue
        self.trainer = trainer
        self.world = trainer.world
        self.checkpoints = checkpoints
        self.publisher = publisher
        self.base_model_dir = base_model_dir
        self.on_designer_reward = on_designer_reward
        self.reward_config: DesignerRewardConfig = settings.rewards.to_config()
        self.version = 0
        self.window = DesignerWindow(
            k=settings.window_versions,
            config=self.reward_config,
            group_size=settings.agent_group_size,
            grace=settings.window_grace_versions,
        )
        self.groups: dict[str, list[AgentPlaySample]] = {}
        self.totals: Counter[str] = Counter()
        self._seen: set[str] = set()
        self._unacked: list[tuple[str, str]] = []
        self._step_counts: Counter[str] = Counter()
        if self.world.is_main and queue is None:
            raise ValueError("the main rank's learner needs a queue")

    # ------------------------------------------------------------------ state and resume

    def state(self) -> dict[str, Any]:
        """The curriculum state as JSON data (window, buffered groups, totals, version)."""
        return {
            "version": self.version,
            "window": self.window.to_json(),
            "groups": {k: [play_sample_to_json(p) for p in v] for k, v in self.groups.items()},
            "totals": dict(self.totals),
        }

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore ``state()`` output."""
        self.version = int(state["version"])
        self.window = DesignerWindow.from_json(
            state["window"],
            self.reward_config,
            group_size=self.settings.agent_group_size,
            grace=self.settings.window_grace_versions,
        )
        self.groups = {k: [play_sample_from_json(p) for p in v] for k, v in state["groups"].items()}
        self.totals = Counter(state.get("totals", {}))

    def resume(self) -> int | None:
        """Load the newest checkpoint (model, optimizer, state); returns its step or ``None``."""
        restored = self.checkpoints.load(self.trainer.model, self.trainer.optimizer)
        if restored is None:
            return None
        self.load_state(restored.state)
        logger.info("resumed from %s at weight version %d", restored.path, self.version)
        return restored.step

    # ------------------------------------------------------------------ consuming

    def _accept(self, delivery: Delivery) -> None:
        self._unacked.append((delivery.stream, delivery.message_id))
        counts = self._step_counts
        try:
            if delivery.stream == SAMPLES_AGENT:
                msg = queues_pb2.AgentSample.FromString(delivery.payload)
                self._accept_agent(msg)
            else:
                dmsg = queues_pb2.DesignerSample.FromString(delivery.payload)
                if dmsg.sample_id in self._seen or not self.window.add_attempt(designer_attempt(dmsg)):
                    counts["duplicates"] += 1
                    return
                self._seen.add(dmsg.sample_id)
                counts["designer_received"] += 1
        except (BatchError, ValueError, DecodeError) as exc:  # the message is malformed: count it, never block on it
            counts["malformed"] += 1
            logger.error("dropping malformed message %s on %s: %s", delivery.message_id, delivery.stream, exc)

    def _accept_agent(self, msg: queues_pb2.AgentSample) -> None:
        counts = self._step_counts
        if msg.sample_id in self._seen:
            counts["duplicates"] += 1
            return
        play = agent_play(msg)
        trainable = not msg.hinted or self.settings.train_on_hinted
        agent_sample = agent_train_sample(msg) if trainable else None  # validated before anything is recorded
        self._seen.add(msg.sample_id)
        self.window.record_play(play)
        counts["agent_received"] += 1
        if agent_sample is not None:
            self.groups.setdefault(agent_sample.group_key, []).append(agent_sample)

    async def _poll(self, block_ms: int) -> int:
        assert self.queue is not None
        got = 0
        for stream in (SAMPLES_DESIGNER, SAMPLES_AGENT):
            deliveries = await self.queue.consume(
                stream,
                self.settings.consumer_group,
                self.settings.consumer_name,
                count=256,
                block_ms=block_ms if stream == SAMPLES_AGENT else 0,
            )
            for d in deliveries:
                self._accept(d)
            got += len(deliveries)
        return got

    def _complete_groups(self) -> list[str]:
        size = self.settings.agent_group_size
        return [k for k, v in self.groups.items() if len(v) >= size]

    async def _fill(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.fill_timeout_s
        while True:
            remaining_ms = int(max(0.0, deadline - loop.time()) * 1000)
            await self._poll(block_ms=min(1000, max(1, remaining_ms)))
            if len(self._complete_groups()) >= self.settings.agent_groups_per_step:
                return
            if loop.time() >= deadline:
                return

    # ------------------------------------------------------------------ batch assembly

    def _drop_stale(self) -> None:
        floor = self.version - self.settings.max_staleness
        for key in [k for k, v in self.groups.items() if min(p.sample.weight_version for p in v) < floor]:
            self._step_counts["stale_dropped"] += len(self.groups[key])
            self._step_counts["stale_groups_dropped"] += 1
            del self.groups[key]

    def _take_groups(self) -> list[AgentPlaySample]:
        ready = self._complete_groups()
        if len(ready) < self.settings.agent_groups_per_step:
            # The fill timed out: groups of an older version will not grow any more; take them too.
            ready += [
                k
                for k, v in self.groups.items()
                if k not in ready and len(v) >= 2 and max(p.sample.weight_version for p in v) < self.version
            ]
        ready.sort(key=lambda k: min(p.sample.weight_version for p in self.groups[k]))
        chosen: list[str] = []
        for key in ready:
            if group_zscores([p.episode_return for p in self.groups[key]]) is None:
                # No learning signal: drop it now so it never takes a trainable group's place.
                self._step_counts["agent_groups_zero_variance"] += 1
                self._step_counts["zero_variance_dropped"] += len(self.groups.pop(key))
            elif len(chosen) < self.settings.agent_groups_per_step:
                chosen.append(key)
        if len(chosen) < max(1, self.settings.min_agent_groups):
            return []
        return [p for key in chosen for p in self.groups.pop(key)]

    def _assemble(self) -> tuple[list[TrainSample], list[ScoredAttempt]]:
        counts = self._step_counts
        self._drop_stale()
        plays = self._take_groups()
        agent, kept, dropped = agent_advantages(plays)
        counts["agent_groups"] += kept
        counts["agent_groups_zero_variance"] += dropped
        scored = self.window.due(self.version)
        for s in scored:
            counts[f"designer_{s.outcome.value}"] += 1
            if s.outcome is ScoreOutcome.UNSCORABLE:
                logger.error("designer sample %s cannot be scored: %s", s.attempt.sample_id, s.reason)
        designer, dkept, ddropped = designer_advantages(scored)
        counts["designer_groups"] += dkept
        counts["designer_groups_zero_variance"] += ddropped
        keep = self.window.k + self.window.grace + self.settings.max_staleness + 1
        counts["envs_pruned"] += self.window.prune(self.version, keep)
        batch = agent + designer
        if self.settings.role_normalization:
            batch = normalize_per_role(batch)
        return batch, scored

    # ------------------------------------------------------------------ the step

    def _execute(self, plan: _Plan) -> tuple[StepMetrics | None, Path | None, Path | None]:
        """The collective part of a step, run identically on every rank (in a worker thread)."""
        metrics = self.trainer.train_step(plan.batch) if plan.batch else None
        weights = None
        if plan.publish_version is not None:
            target = self.settings.weights_dir / f"v{plan.publish_version:08d}"
            weights = write_weights(self.trainer.model, target, base_model_dir=self.base_model_dir, world=self.world)
        ckpt = None
        if plan.checkpoint_step is not None:
            ckpt = self.checkpoints.save(plan.checkpoint_step, self.trainer.model, self.trainer.optimizer, plan.state)
        return metrics, weights, ckpt

    async def run_step(self) -> StepReport:
        """Gather one batch and train on it (see the module docstring)."""
        if not self.world.is_main:
            raise RuntimeError("run_step runs on rank 0; other ranks call follow()")
        self._step_counts = Counter()
        await self._fill()
        batch, scored = self._assemble()
        for s in scored:
            if self.on_designer_reward is not None:
                self.on_designer_reward(s)
        trained = bool(batch)
        behind = staleness(batch, self.version)
        next_version = self.version + 1 if trained else self.version
        publish_version = next_version if trained and next_version % self.settings.publish_every == 0 else None
        checkpoint_step = next_version if trained and next_version % self.settings.checkpoint_every == 0 else None
        if trained:
            self.version = next_version
        self._step_counts["trained_samples"] = len(batch)
        self.totals.update(self._step_counts)
        state = self.state()
        plan = _Plan(batch, publish_version, checkpoint_step, state)
        if self.world.distributed:
            await asyncio.to_thread(self.world.broadcast_object, plan)
        metrics, weights, ckpt = await asyncio.to_thread(self._execute, plan)
        publish = None
        if publish_version is not None and weights is not None and self.publisher is not None:
            publish = await self.publisher.publish(publish_version, weights)
        if ckpt is not None:
            await self._ack_all()
        write_json_atomic(self.settings.checkpoint_dir / "learner_state.json", state)
        report = StepReport(
            self.version, trained, metrics, dict(self._step_counts), scored, publish, ckpt, staleness=behind
        )
        logger.info("learner step %s", json.dumps(report.flat_metrics(), sort_keys=True))
        return report

    async def _ack_all(self) -> None:
        assert self.queue is not None
        for stream, message_id in self._unacked:
            await self.queue.ack(stream, self.settings.consumer_group, message_id)
        self._unacked.clear()
        # Acked messages never come back; ids still buffered stay known through the buffer.
        self._seen = {p.sample.sample_id for v in self.groups.values() for p in v} | set(self.window.pending)

    async def run(self, max_steps: int | None = None, stop: asyncio.Event | None = None) -> list[StepReport]:
        """Step until ``max_steps`` trained steps or ``stop`` is set; returns every step's report."""
        reports: list[StepReport] = []
        trained = 0
        try:
            while (max_steps is None or trained < max_steps) and not (stop is not None and stop.is_set()):
                report = await self.run_step()
                reports.append(report)
                trained += report.trained
        finally:
            if self.world.distributed:
                await asyncio.to_thread(self.world.broadcast_object, _Plan([], None, None, {}, stop=True))
        return reports

    def follow(self) -> None:
        """Non-main ranks under torchrun: join every step's collectives until rank 0 stops."""
        while True:
            plan: _Plan = self.world.broadcast_object(None)
            if plan.stop:
                return
            self._execute(plan)
            if plan.batch:
                self.version += 1
