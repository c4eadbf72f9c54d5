"""The learner loop: consume samples, score designers, train, checkpoint, publish — never going back.

One ``run_step`` call composes the learner's parts:

1. **intake** (``intake.py``) drains ``envs.audited``, ``samples.designer`` and ``samples.agent``
   into the sample journal (fsynced, then acknowledged at once: the queue re-delivers only after a
   crash) and the buffer: plays into their env's window accumulator by slot and, unless hinted,
   into their advantage group; designer samples and audit verdicts into the window. Samples of
   another run spec are refused (acknowledged, counted as ``refused_spec``, logged with the reason).
   It stops when ``agent_groups_per_step`` groups are complete or ``fill_timeout_s`` has passed; a
   stop request (SIGTERM) abandons the fill — nothing is lost, the samples stay buffered;
2. the **step plan** (``core/plan.py``, a pure function of the buffer) drops stale and zero-variance
   groups, chooses the groups that train and their z-scores, scores the designer rounds whose
   windows are done (an attempt is never scored before its env's audit verdict when the run audits
   its envs) and centres their blends per (round, skill) with the skill's running mean for small
   groups (``spade.signal``), then scales each role's advantages; the intake removes what it took;
3. every rank trains one step on the plan's batch (``collective.execute``, in a worker thread; under
   ``torchrun`` rank 0 broadcasts the work first): the weight version becomes N+1;
4. a version to publish (every ``publish_every`` steps) is written, **checkpointed**, and only then
   published, so the published version never exceeds the checkpointed one; other versions are
   checkpointed every ``checkpoint_every`` steps (``versions.py``).

On start (``resume``) the learner restores the newest checkpoint, replays the journal written since,
refuses to start when ``weights_dir/latest`` is ahead of it (it would go back in time), and finishes
a publication that a crash interrupted. ``run`` checkpoints once more when it stops (SIGTERM).

Under ``torchrun`` this class runs on rank 0 alone: it reads the queue, talks HTTP and writes
files. The other ranks are ``collective.Follower``s, which receive each step's work and join the
collectives.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from services.learner.checkpoint import CheckpointManager, write_json_atomic
from services.learner.collective import StepWork, execute
from services.learner.core.batching import AgentPlaySample, TrainSample, staleness
from services.learner.core.plan import PlanRules, StepPlan, plan_step
from services.learner.core.window import DesignerWindow, ScoredAttempt
from services.learner.intake import Intake
from services.learner.journal import SampleJournal
from services.learner.publisher import WeightPublisher
from services.learner.report import StepReport
from services.learner.settings import LearnerSettings
from services.learner.trainer import Trainer
from services.learner.versions import ResumeError, Versions, VersionWriter, check_checkpoint_spec
from spade.queues.base import WorkQueue
from spade.runspec import RunSpec
from spade.serving import lifecycle
from spade.serving.logs import get_logger, log_event
from spade.signal import SkillBaselines

__all__ = ["Learner", "ResumeError", "RewardCallback", "StepReport"]

logger = get_logger(__name__)

RewardCallback = Callable[[ScoredAttempt], Awaitable[None] | None]
"""Receives every designer attempt whose window closed (e.g. to store its components in the memory);
a coroutine function is awaited."""


class Learner:
    """The learner service's loop on rank 0, or in a single process (see the module docstring).

    Args:
        settings: Learner settings.
        spec: The run spec (G, k per setting, the reward constants; its id is checked on every sample).
        queue: The work queue.
        trainer: The torch trainer.
        checkpoints: Checkpoint manager.
        publisher: Weight publisher (``None`` to skip publishing).
        journal: The sample journal; default: ``<checkpoint_dir>/journal``.
        base_model_dir: Tokenizer files are copied from here into each published version.
        on_designer_reward: Optional callback for every scored designer attempt.

    Raises:
        ValueError: The trainer's world is not rank 0 (other ranks are ``collective.Follower``s).
    """

    def __init__(
        self,
        settings: LearnerSettings,
        spec: RunSpec,
        queue: WorkQueue,
        trainer: Trainer,
        checkpoints: CheckpointManager,
        publisher: WeightPublisher | None,
        *,
        journal: SampleJournal | None = None,
        base_model_dir: Path | None = None,
        on_designer_reward: RewardCallback | None = None,
    ) -> None:
        settings.check_spec(spec)
        if not trainer.world.is_main:
            raise ValueError(
                f"the Learner runs on rank 0, not rank {trainer.world.rank}: the other ranks follow "
                "(collective.Follower, built by wiring.build_follower)"
            )
        self.settings = settings
        self.spec = spec
        self.trainer = trainer
        self.world = trainer.world
        self.checkpoints = checkpoints
        self.on_designer_reward = on_designer_reward
        self.intake = Intake(settings, spec, queue, journal or SampleJournal(settings.checkpoint_dir / "journal"))
        self.writer = VersionWriter(trainer, checkpoints, settings.weights_dir, base_model_dir)
        self.versions = Versions(settings, checkpoints, publisher)
        self.rules = PlanRules(
            group_size=spec.group_size,
            groups_per_step=settings.agent_groups_per_step,
            min_groups=settings.min_agent_groups,
            max_staleness=settings.max_staleness,
            resource_fault_policy=settings.resource_fault_policy,
            role_normalization=settings.role_normalization,
        )
        self.version = 0
        self.baselines = SkillBaselines(length=settings.skill_baseline_length)
        self.totals: Counter[str] = Counter()
        self._idle_since = time.monotonic()
        self._last_wait_log = time.monotonic()

    @property
    def queue(self) -> WorkQueue:
        """The work queue the intake drains."""
        return self.intake.queue

    @property
    def journal(self) -> SampleJournal:
        """The sample journal."""
        return self.intake.journal

    @property
    def groups(self) -> dict[str, list[AgentPlaySample]]:
        """Buffered agent plays by advantage group."""
        return self.intake.groups

    @property
    def window(self) -> DesignerWindow:
        """The designer window (plays by slot, pending designer attempts, audit verdicts)."""
        return self.intake.window

    @property
    def publisher(self) -> WeightPublisher | None:
        """The weight publisher (replaceable, e.g. by a timing wrapper; ``None``: versions are not published)."""
        return self.versions.publisher

    @publisher.setter
    def publisher(self, publisher: WeightPublisher | None) -> None:
        self.versions.publisher = publisher

    @property
    def checkpointed_version(self) -> int | None:
        """The version of the newest checkpoint this learner wrote or resumed from (``None``: none yet)."""
        return self.versions.checkpointed

    # ------------------------------------------------------------------ state and resume

    def state(self) -> dict[str, Any]:
        """The curriculum state as JSON data (version, spec, window, baselines, buffered groups, totals)."""
        return {
            "version": self.version,
            "spec_id": self.spec.spec_id,
            "window": self.intake.window.to_json(),
            "baselines": self.baselines.to_dict(),
            "groups": self.intake.groups_to_json(),
            "totals": dict(self.totals),
        }

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore ``state()`` output.

        Raises:
            ResumeError: The state was written under another run spec.
        """
        check_checkpoint_spec(state, self.spec.spec_id)
        self.version = int(state["version"])
        self.intake.restore(state["window"], state["groups"])
        if "baselines" in state:  # kept at this learner's configured length
            recent = SkillBaselines.from_dict(state["baselines"]).recent
            self.baselines = SkillBaselines(length=self.settings.skill_baseline_length, recent=recent)
        self.totals = Counter(state.get("totals", {}))

    def resume(self) -> int | None:
        """Restore the newest checkpoint and the journal since; returns the checkpoint's step or ``None``.

        Raises:
            ResumeError: ``weights_dir/latest`` is ahead of the checkpoint, or the checkpoint belongs
                to another run spec.
        """
        restored = self.checkpoints.load(self.trainer.model, self.trainer.optimizer)
        journal_from = 0
        pending = None
        if restored is not None:
            self.load_state(restored.state)
            self.versions.checkpointed = restored.step
            journal_from = int(restored.state.get("journal_from", 0))
            pending = restored.state.get("publish_pending")
        self.versions.check_not_behind(self.version)
        replayed = self.intake.replay(journal_from)
        counts = self.intake.take_counts()
        self.totals.update(counts)
        if restored is not None or replayed:
            where = str(restored.path) if restored is not None else "the journal alone (no checkpoint yet)"
            lifecycle.resumed(
                f"resumed from {where} at weight version {self.version}, {replayed} journal messages "
                "received after it replayed",
                checkpoint=None if restored is None else str(restored.path),
                version=self.version,
                journal_from=journal_from,
                journal_messages=replayed,
                replayed=dict(counts),
            )
        self.versions.resume_pending(pending, self.version)
        return None if restored is None else restored.step

    def start_fresh(self) -> None:
        """Start without resuming (``resume=false``): the journal is cleared.

        Raises:
            ResumeError: Versions were already published from ``weights_dir``.
        """
        self.versions.check_not_behind(self.version)
        self.journal.clear()

    def _checkpoint_state(self, publish_version: int | None) -> dict[str, Any]:
        state = self.state()
        state["journal_from"] = self.journal.rotate()  # everything before is reflected in ``state``
        state["publish_pending"] = publish_version
        return state

    # ------------------------------------------------------------------ the step

    async def run_step(
        self, stop: asyncio.Event | None = None, on_assembled: Callable[[], None] | None = None
    ) -> StepReport:
        """Gather one batch and train on it (see the module docstring).

        Args:
            stop: When set, the fill is abandoned and the step returns untrained (``stopped``).
            on_assembled: Called once the batch is taken from the queues and planned (the designer
                rewards reported), before the training: what arrives on the queues after it belongs to
                the next step. The embedded run's overlap starts the next step's generation there.
        """
        self.intake.counts.clear()  # a step that raised leaves nothing behind
        await self.intake.flush_acks()
        await self.versions.finish_pending()
        started = time.perf_counter()
        if not await self.intake.fill(stop, self.version):
            counts = self.intake.take_counts()
            self.totals.update(counts)
            return StepReport(self.version, False, None, dict(counts), stopped=True)
        filled = time.perf_counter()

        plan, counts = self._plan()
        await self._report_rewards(plan.scored)
        trained = bool(plan.batch)
        behind = staleness(plan.batch, self.version)
        publish_version = checkpoint_step = None
        if trained:
            publish_version, checkpoint_step = self.versions.milestones(self.version + 1)
            self.version += 1
        self.totals.update(counts)
        state = self._checkpoint_state(publish_version) if checkpoint_step is not None else self.state()

        work = StepWork(plan.batch, publish_version, checkpoint_step, state)
        await self._broadcast(work)
        assembled = time.perf_counter()
        if on_assembled is not None:
            on_assembled()
        done = await asyncio.to_thread(execute, work, self.trainer, self.writer)
        timings = {"wait": filled - started, "assemble": assembled - filled, **done.timings}
        if done.checkpoint is not None:
            self.versions.checkpointed = checkpoint_step
            self.journal.discard(state["journal_from"])
        publish = None
        if publish_version is not None and done.weights is not None:
            clock = time.perf_counter()
            publish = await self.versions.publish(publish_version, done.weights)
            timings["publish"] = time.perf_counter() - clock
        write_json_atomic(self.settings.checkpoint_dir / "learner_state.json", state)
        self.intake.report(self.version)

        report = StepReport(
            self.version,
            trained,
            done.metrics,
            dict(counts),
            plan.scored,
            publish,
            done.checkpoint,
            staleness=behind,
            advantages=plan.advantages,
            timings=timings,
        )
        self._log_step(report, plan.batch)
        return report

    def _plan(self) -> tuple[StepPlan, Counter[str]]:
        """This step's plan, applied to the buffer, with the step's counts so far (intake and plan)."""
        counts = self.intake.take_counts()
        plan = plan_step(self.intake.groups, self.intake.window, self.baselines, self.version, self.rules)
        counts.update(plan.counters)
        pruned = self.intake.apply(plan, self.version)
        if pruned:
            counts["envs_pruned"] += pruned
        self.baselines = plan.baselines
        for s in plan.scored:
            if s.trivially_won:
                log_event(
                    logger,
                    "designer_trivially_won",
                    f"designer sample {s.attempt.sample_id} is rescored invalid: {s.reason}",
                    level=logging.WARNING,
                    env_id=s.attempt.env_id,
                    spec_id=self.spec.spec_id,
                )
        for s in plan.designer.unscorable:
            code = s.reason_code.value if s.reason_code is not None else "unknown"
            log_event(
                logger,
                "designer_unscored",
                f"designer sample {s.attempt.sample_id} is not scored ({code}): {s.reason}",
                level=logging.WARNING,
                reason=code,
                spec_id=self.spec.spec_id,
            )
        return plan, counts

    async def _report_rewards(self, scored: list[ScoredAttempt]) -> None:
        if self.on_designer_reward is None:
            return
        for s in scored:
            result = self.on_designer_reward(s)
            if inspect.isawaitable(result):
                await result

    async def _broadcast(self, work: StepWork) -> None:
        """Send the work to the follower ranks (under torchrun), which run it with this rank."""
        if self.world.distributed:
            await asyncio.to_thread(self.world.broadcast_object, work)

    def _log_step(self, report: StepReport, batch: list[TrainSample]) -> None:
        now = time.monotonic()
        if report.trained:
            self._idle_since = now
            fields: dict[str, Any] = {
                "spec_id": self.spec.spec_id,
                "version": report.version,
                "groups": report.counters.get("agent_groups", 0),
                "designer_samples": report.counters.get("designer_trained", 0),
                "samples": len(batch),
                "publish": report.publish.version if report.publish is not None else None,
                "checkpoint": str(report.checkpoint) if report.checkpoint is not None else None,
            }
            figures = json.dumps({"event": "learner_step", **fields, **report.flat_metrics()}, sort_keys=True)
            log_event(logger, "learner_step", f"learner_step {figures}", **fields)
        elif now - self._last_wait_log >= self.settings.wait_log_s:
            self._last_wait_log = now
            waited = now - self._idle_since
            waiting: dict[str, Any] = {"for": "samples", "waited_s": round(waited), "spec_id": self.spec.spec_id}
            log_event(
                logger,
                "waiting",
                f"learner waiting for samples: {len(self.intake.complete_groups())} of "
                f"{self.settings.agent_groups_per_step} agent groups complete, "
                f"{sum(len(v) for v in self.intake.groups.values())} plays buffered, "
                f"{len(self.intake.window.pending)} designer samples waiting for their windows; {waited:.0f} s since "
                f"the last trained step (version {self.version})",
                **waiting,
            )

    async def checkpoint_now(self) -> Path | None:
        """Checkpoint the current state (at a stop): a new checkpoint when the version moved, else its state.

        Returns the checkpoint's path (``None`` when nothing was trained or received yet: the journal
        already holds every received sample).
        """
        checkpointed = self.versions.checkpointed
        path: Path | None
        if checkpointed is not None and checkpointed == self.version:
            state = self._checkpoint_state(self.versions.pending)
            path = self.checkpoints.update_state(self.version, state)
        elif self.version > (checkpointed or 0):
            state = self._checkpoint_state(self.versions.pending)
            work = StepWork([], None, self.version, state)
            await self._broadcast(work)
            path = (await asyncio.to_thread(execute, work, self.trainer, self.writer)).checkpoint
            self.versions.checkpointed = self.version
        else:
            return None
        self.journal.discard(state["journal_from"])
        write_json_atomic(self.settings.checkpoint_dir / "learner_state.json", state)
        log_event(logger, "checkpoint", f"checkpointed version {self.version} at {path}")
        return path

    async def run(self, max_steps: int | None = None, stop: asyncio.Event | None = None) -> list[StepReport]:
        """Step until ``max_steps`` trained steps or ``stop`` is set; returns every step's report.

        A stop request abandons the step being filled (a training step in flight finishes), then the
        state is checkpointed. The followers are told to stop in any case.
        """
        reports: list[StepReport] = []
        trained = 0
        try:
            while (max_steps is None or trained < max_steps) and not (stop is not None and stop.is_set()):
                report = await self.run_step(stop)
                reports.append(report)
                trained += report.trained
            await self.checkpoint_now()
        finally:
            await self._broadcast(StepWork([], None, None, {}, stop=True))
            self.journal.close()
        return reports
