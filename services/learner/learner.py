"""The learner loop: consume samples, score designers, train, checkpoint, publish — never going back.

One ``run_step`` call:

1. drains ``envs.audited``, ``samples.designer`` and ``samples.agent``. Each poll's messages are appended to the
   sample journal and fsynced, then acknowledged at once (``journal.py``): the queue re-delivers
   only what never reached the journal, i.e. only after a crash. Samples of another run spec are
   refused (acknowledged, counted as ``refused_spec``, logged with the reason). Every play goes into
   its env's window accumulator by slot and, unless hinted, into its advantage group (one env, one
   window slot, one arm); designer samples wait in the window, and so do the rollout's audit
   verdicts: an attempt is never scored before its env's verdict when the run audits its envs, and
   an env trivially won makes its attempt invalid (``core/window.py``);
2. stops when ``agent_groups_per_step`` groups are complete or ``fill_timeout_s`` has passed; a stop
   request (SIGTERM) abandons the fill — nothing is lost, the samples stay buffered;
3. scores the designer rounds whose windows are done (``core/window.py``), drops stale and
   zero-variance groups, assigns advantages (z-scores per group; per-(round, skill) centred blends
   with the skill's running mean for small groups, ``spade.signal``; per-role scaling);
4. trains one step (``Trainer.train_step`` in a worker thread): the weight version becomes N+1;
5. a version to publish (every ``publish_every`` steps) is written, **checkpointed**, and only then
   published, so the published version never exceeds the checkpointed one; other versions are
   checkpointed every ``checkpoint_every`` steps.

On start (``resume``) the learner restores the newest checkpoint, replays the journal written since,
refuses to start when ``weights_dir/latest`` is ahead of it (it would go back in time), and finishes
a publication that a crash interrupted. ``run`` checkpoints once more when it stops (SIGTERM).

Under ``torchrun`` every rank runs the same loop; rank 0 alone reads the queue, talks HTTP and
writes files, and broadcasts each step's plan to the other ranks, which join the collectives.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from google.protobuf.message import DecodeError

from services.learner.buffer import ANNOUNCED_FILE, LearnerBuffer, read_announced, write_buffer
from services.learner.checkpoint import CheckpointManager, copy_weights, write_json_atomic, write_weights
from services.learner.core.batching import (
    AgentPlaySample,
    BatchError,
    TrainSample,
    agent_advantages,
    designer_advantages,
    normalize_per_role,
    staleness,
    trainable_members,
)
from services.learner.core.window import Audit, DesignerWindow, ScoredAttempt
from services.learner.journal import JournalRecord, SampleJournal
from services.learner.latest import check_unpublished
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
from spade.inference.published import published_version
from spade.queues.base import ENVS_AUDITED, SAMPLES_AGENT, SAMPLES_DESIGNER, WorkQueue
from spade.runspec import RunSpec
from spade.serving import lifecycle
from spade.signal import DesignerRewardConfig, SkillBaselines, group_has_signal
from spade.v1 import queues_pb2

logger = logging.getLogger(__name__)

RewardCallback = Callable[[ScoredAttempt], Awaitable[None] | None]
"""Receives every designer attempt whose window closed (e.g. to store its components in the memory);
a coroutine function is awaited."""


class ResumeError(RuntimeError):
    """The learner cannot start from what is on disk without going back in time (the message says how to fix it)."""


@dataclass
class StepReport:
    """What one ``run_step`` did.

    Attributes:
        version: The learner's weight version after the step.
        trained: Whether an optimiser step happened (False when nothing trainable was ready).
        metrics: The trainer's metrics (``None`` when not trained).
        counters: Counts of this step (samples, groups kept/dropped, stale, duplicates, refusals,
            resource faults per reason, designer attempts by outcome and unscored reason, ...).
        designer_rewards: The designer attempts scored in this step.
        publish: The weight publication, when this step published.
        checkpoint: The checkpoint written by this step, if any.
        staleness: Versions behind the learner of the trained samples' weights, per role (mean, max).
        advantages: ``designer/advantage_nonzero_frac``, ``designer/advantage_abs_mean`` and
            ``agent/advantage_abs_mean`` (before per-role scaling), when the step had any.
        stopped: The step was abandoned because the learner was told to stop.
        timings: Seconds of the step's parts, one after another: ``wait`` (for enough samples),
            ``assemble`` (the batch and the designer rewards), ``train`` (the optimiser step),
            ``weights`` (writing the version to publish), ``checkpoint``, ``publish`` (until the
            inference servers acknowledged the new weights, reload included). In the step's log line
            and ``flat_metrics`` as ``time/<part>_s``.
    """

    version: int
    trained: bool
    metrics: StepMetrics | None
    counters: dict[str, int]
    designer_rewards: list[ScoredAttempt] = field(default_factory=list)
    publish: PublishResult | None = None
    checkpoint: Path | None = None
    staleness: dict[str, float] = field(default_factory=dict)
    advantages: dict[str, float] = field(default_factory=dict)
    stopped: bool = False
    timings: dict[str, float] = field(default_factory=dict)

    def flat_metrics(self) -> dict[str, float]:
        """Every figure of the step under one flat namespace (for logs and dashboards)."""
        out: dict[str, float] = {"version": float(self.version)}
        if self.metrics is not None:
            out.update(self.metrics.as_dict())
        out.update({f"count/{k}": float(v) for k, v in self.counters.items()})
        out.update(self.staleness)
        out.update(self.advantages)
        out.update({f"time/{part}_s": round(seconds, 4) for part, seconds in self.timings.items()})
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
        spec: The run spec (G, k per setting, the reward constants; its id is checked on every sample).
        queue: The work queue (``None`` on non-main ranks).
        trainer: The torch trainer.
        checkpoints: Checkpoint manager.
        publisher: Weight publisher (``None`` on non-main ranks, or to skip publishing).
        journal: The sample journal (``None`` on non-main ranks); default: ``<checkpoint_dir>/journal``.
        base_model_dir: Tokenizer files are copied from here into each published version.
        on_designer_reward: Optional callback for every scored designer attempt.
    """

    def __init__(
        self,
        settings: LearnerSettings,
        spec: RunSpec,
        queue: WorkQueue | None,
        trainer: Trainer,
        checkpoints: CheckpointManager,
        publisher: WeightPublisher | None,
        *,
        journal: SampleJournal | None = None,
        base_model_dir: Path | None = None,
        on_designer_reward: RewardCallback | None = None,
    ) -> None:
        settings.check_spec(spec)
        self.settings = settings
        self.spec = spec
        self.queue = queue
        self.trainer = trainer
        self.world = trainer.world
        self.checkpoints = checkpoints
        self.publisher = publisher
        self.base_model_dir = base_model_dir
        self.on_designer_reward = on_designer_reward
        self.reward_config: DesignerRewardConfig = spec.rewards.to_config()
        self.windows = {"game": spec.window_versions_game, "tool": spec.window_versions_tool}
        self.version = 0
        self.window = self._new_window()
        self.baselines = SkillBaselines(length=settings.skill_baseline_length)
        self.groups: dict[str, list[AgentPlaySample]] = {}
        self.totals: Counter[str] = Counter()
        self._seen: set[str] = set()
        self._to_ack: list[tuple[str, str]] = []
        self._step_counts: Counter[str] = Counter()
        self._checkpointed: int | None = None
        self._pending_publish: int | None = None
        self._foreign_specs: set[str] = set()
        self._idle_since = time.monotonic()
        self._last_wait_log = time.monotonic()
        if self.world.is_main and queue is None:
            raise ValueError("the main rank's learner needs a queue")
        self.journal = journal
        if self.world.is_main and journal is None:
            self.journal = SampleJournal(settings.checkpoint_dir / "journal")

    def _new_window(self, data: dict[str, Any] | None = None) -> DesignerWindow:
        empty: dict[str, Any] = {"plays": {}, "pending": []}
        return DesignerWindow.from_json(
            data if data is not None else empty,
            self.windows,
            self.reward_config,
            group_size=self.spec.group_size,
            grace=self.settings.window_grace_versions,
            first_play_grace=self.settings.first_play_grace_versions,
            await_audit=self.spec.audit_plays > 0,
        )

    # ------------------------------------------------------------------ state and resume

    def state(self) -> dict[str, Any]:
        """The curriculum state as JSON data (version, spec, window, baselines, buffered groups, totals)."""
        return {
            "version": self.version,
            "spec_id": self.spec.spec_id,
            "window": self.window.to_json(),
            "baselines": self.baselines.to_dict(),
            "groups": {k: [play_sample_to_json(p) for p in v] for k, v in self.groups.items()},
            "totals": dict(self.totals),
        }

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore ``state()`` output.

        Raises:
            ResumeError: The state was written under another run spec.
        """
        stored_spec = state.get("spec_id")
        if stored_spec is not None and stored_spec != self.spec.spec_id:
            raise ResumeError(
                f"the checkpoint was written under run spec {stored_spec} but this run's spec is "
                f"{self.spec.spec_id}; its pending windows and buffered samples belong to the other spec: restore "
                f"that spec, or start this spec's run with a fresh checkpoint_dir and weights_dir"
            )
        self.version = int(state["version"])
        self.window = self._new_window(state["window"])
        if "baselines" in state:  # kept at this learner's configured length
            recent = SkillBaselines.from_dict(state["baselines"]).recent
            self.baselines = SkillBaselines(length=self.settings.skill_baseline_length, recent=recent)
        self.groups = {k: [play_sample_from_json(p) for p in v] for k, v in state["groups"].items()}
        self.totals = Counter(state.get("totals", {}))
        self._seen = self._held_ids()

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
            self._checkpointed = restored.step
            journal_from = int(restored.state.get("journal_from", 0))
            pending = restored.state.get("publish_pending")
        if self.world.is_main:
            self._check_published()
            replayed = self._replay(journal_from)
            if restored is not None or replayed:
                where = str(restored.path) if restored is not None else "the journal alone (no checkpoint yet)"
                lifecycle.resumed(
                    f"resumed from {where} at weight version {self.version}, {replayed} journal messages "
                    "received after it replayed",
                    checkpoint=None if restored is None else str(restored.path),
                    version=self.version,
                    journal_from=journal_from,
                    journal_messages=replayed,
                    replayed=dict(self._step_counts),
                )
            if pending is not None and int(pending) == self.version and self._announced() < self.version:
                self._pending_publish = self.version
        elif restored is not None:
            logger.info("resumed from %s at weight version %d", restored.path, self.version)
        return None if restored is None else restored.step

    def start_fresh(self) -> None:
        """Start without resuming (``resume=false``): the journal is cleared.

        Raises:
            ResumeError: Versions were already published from ``weights_dir``.
        """
        if self.world.is_main:
            assert self.journal is not None
            self._check_published()
            self.journal.clear()

    def _check_published(self) -> None:
        published = published_version(self.settings.weights_dir)
        if published > self.version:
            raise ResumeError(
                f"{self.settings.weights_dir}/latest points at published version {published} but the learner's "
                f"newest checkpoint is at version {self.version} (in {self.settings.checkpoint_dir}); starting "
                "here would serve older weights under newer version numbers. Restore the checkpoint directory "
                "of that run, or start a new run with a fresh weights_dir"
            )

    def _announced(self) -> int:
        return read_announced(self.settings.checkpoint_dir)

    def _replay(self, journal_from: int) -> int:
        """Accept the journal's messages from segment ``journal_from`` on; returns how many."""
        assert self.journal is not None
        self._step_counts = Counter()
        replayed = 0
        for record in self.journal.replay(journal_from):
            self._accept(record.stream, record.payload)
            self._to_ack.append((record.stream, record.message_id))
            replayed += 1
        if replayed:
            logger.info(
                "replayed %d messages from the sample journal (received after the checkpoint): %s",
                replayed,
                dict(self._step_counts),
            )
        self.totals.update(self._step_counts)
        return replayed

    @property
    def checkpointed_version(self) -> int | None:
        """The version of the newest checkpoint this learner wrote or resumed from (``None``: none yet)."""
        return self._checkpointed

    def _held_ids(self) -> set[str]:
        return {p.sample.sample_id for v in self.groups.values() for p in v} | set(self.window.pending)

    # ------------------------------------------------------------------ consuming

    def _same_spec(self, spec_id: str, sample_id: str, role: str) -> bool:
        if spec_id == self.spec.spec_id:
            return True
        self._step_counts["refused_spec"] += 1
        message = (
            f"refusing {role} sample {sample_id}: made under run spec {spec_id or '(none)'!r} but this learner "
            f"runs spec {self.spec.spec_id!r} (acknowledged, counted as refused_spec, never trained); every "
            "service of a run must read one spec (`spade runspec show`)"
        )
        if spec_id not in self._foreign_specs:
            self._foreign_specs.add(spec_id)
            logger.error(message, extra={"event": "sample_refused", "reason": "spec_mismatch", "spec_id": spec_id})
        else:
            logger.debug(message)
        return False

    def _accept(self, stream: str, payload: bytes) -> None:
        counts = self._step_counts
        try:
            if stream == SAMPLES_AGENT:
                msg = queues_pb2.AgentSample.FromString(payload)
                if self._same_spec(msg.spec_id, msg.sample_id, "agent"):
                    self._accept_agent(msg)
            elif stream == SAMPLES_DESIGNER:
                dmsg = queues_pb2.DesignerSample.FromString(payload)
                if self._same_spec(dmsg.spec_id, dmsg.sample_id, "designer"):
                    self._accept_designer(dmsg)
            elif stream == ENVS_AUDITED:
                amsg = queues_pb2.EnvAudit.FromString(payload)
                if self._same_spec(amsg.spec_id, f"{amsg.env_id}@audit", "audit"):
                    self._accept_audit(amsg)
            else:
                raise ValueError(f"the learner does not consume stream {stream!r}")
        except (BatchError, ValueError, DecodeError) as exc:  # malformed: count it, never block on it
            counts["malformed"] += 1
            logger.error("dropping a malformed message on %s: %s", stream, exc)

    def _accept_audit(self, msg: queues_pb2.EnvAudit) -> None:
        if not msg.env_id:
            raise ValueError("an audit verdict without env_id: the rollout names the env it audited")
        audit = Audit(msg.env_id, bool(msg.trivially_won), msg.reason, int(msg.window_start))
        if not self.window.record_audit(audit):
            self._step_counts["duplicates"] += 1
            return
        self._step_counts["audits_received"] += 1
        if audit.trivially_won:
            self._step_counts["audits_trivially_won"] += 1

    def _accept_designer(self, msg: queues_pb2.DesignerSample) -> None:
        if msg.sample_id in self._seen or not self.window.add_attempt(designer_attempt(msg)):
            self._step_counts["duplicates"] += 1
            return
        self._seen.add(msg.sample_id)
        self._step_counts["designer_received"] += 1

    def _accept_agent(self, msg: queues_pb2.AgentSample) -> None:
        counts = self._step_counts
        if msg.sample_id in self._seen:
            counts["duplicates"] += 1
            return
        play = agent_play(msg)
        trainable = not msg.hinted or self.settings.train_on_hinted
        agent_sample = agent_train_sample(msg) if trainable else None  # validated before anything is recorded
        if not self.window.record_play(play):
            counts["duplicates"] += 1
            return
        self._seen.add(msg.sample_id)
        counts["agent_received"] += 1
        if agent_sample is not None and agent_sample.resource_fault:
            counts[f"resource_fault/{msg.finish_reason}"] += 1
        if agent_sample is not None:
            self.groups.setdefault(agent_sample.group_key, []).append(agent_sample)

    async def _poll(self, block_ms: int) -> int:
        assert self.queue is not None and self.journal is not None
        got = 0
        for stream in (ENVS_AUDITED, SAMPLES_DESIGNER, SAMPLES_AGENT):
            deliveries = await self.queue.consume(
                stream,
                self.settings.consumer_group,
                self.settings.consumer_name,
                count=256,
                block_ms=block_ms if stream == SAMPLES_AGENT else 0,
            )
            if not deliveries:
                continue
            records = [JournalRecord(d.stream, d.message_id, d.payload) for d in deliveries]
            await asyncio.to_thread(self.journal.append, records)  # durable before it is acknowledged
            for d in deliveries:
                if d.deliveries > 1:
                    self._step_counts["redelivered"] += 1
                self._accept(d.stream, d.payload)
                self._to_ack.append((d.stream, d.message_id))
            await self._flush_acks()
            got += len(deliveries)
        if got:
            self._report_buffer()
        return got

    def _report_buffer(self) -> None:
        """Write the buffer record ``spade cluster status`` shows (``buffer.py``); a failure is only logged."""
        try:
            write_buffer(
                self.settings.checkpoint_dir,
                LearnerBuffer(
                    version=self.version,
                    spec_id=self.spec.spec_id,
                    plays_buffered=sum(len(v) for v in self.groups.values()),
                    groups_complete=len(self._complete_groups()),
                    groups_per_step=self.settings.agent_groups_per_step,
                    group_size=self.spec.group_size,
                    designer_waiting=len(self.window.pending),
                    updated_at=time.time(),
                ),
            )
        except OSError as exc:
            logger.warning("could not write the buffer record: %s", exc)

    async def _flush_acks(self) -> None:
        assert self.queue is not None
        while self._to_ack:
            stream, message_id = self._to_ack[0]
            await self.queue.ack(stream, self.settings.consumer_group, message_id)
            self._to_ack.pop(0)

    def _complete_groups(self) -> list[str]:
        size = self.spec.group_size
        return [k for k, v in self.groups.items() if len(v) >= size]

    async def _fill(self, stop: asyncio.Event | None) -> bool:
        """Poll until a step's groups are complete or the fill times out; ``False`` when told to stop."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.fill_timeout_s
        while True:
            if stop is not None and stop.is_set():
                return False
            remaining_ms = int(max(0.0, deadline - loop.time()) * 1000)
            await self._poll(block_ms=min(1000, max(1, remaining_ms)))
            if len(self._complete_groups()) >= self.settings.agent_groups_per_step:
                return True
            if loop.time() >= deadline:
                return True

    # ------------------------------------------------------------------ batch assembly

    def _drop_stale(self) -> None:
        floor = self.version - self.settings.max_staleness
        for key in [k for k, v in self.groups.items() if min(p.sample.weight_version for p in v) < floor]:
            self._step_counts["stale_dropped"] += len(self.groups[key])
            self._step_counts["stale_groups_dropped"] += 1
            del self.groups[key]

    def _has_signal(self, key: str) -> bool:
        kept = trainable_members(self.groups[key], self.settings.resource_fault_policy)
        return group_has_signal([r for _, r in kept])

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
            if not self._has_signal(key):
                # No learning signal: drop it now so it never takes a trainable group's place.
                self._step_counts["agent_groups_zero_variance"] += 1
                self._step_counts["zero_variance_dropped"] += len(self.groups.pop(key))
            elif len(chosen) < self.settings.agent_groups_per_step:
                chosen.append(key)
        if len(chosen) < max(1, self.settings.min_agent_groups):
            return []
        return [p for key in chosen for p in self.groups.pop(key)]

    def _assemble(self) -> tuple[list[TrainSample], list[ScoredAttempt], dict[str, float]]:
        counts = self._step_counts
        policy = self.settings.resource_fault_policy
        self._drop_stale()
        plays = self._take_groups()
        faults = sum(1 for p in plays if p.resource_fault)
        if faults:
            counts["resource_fault_dropped" if policy == "drop" else "resource_fault_zeroed"] += faults
        agent, kept, dropped = agent_advantages(plays, policy=policy)
        counts["agent_groups"] += kept
        counts["agent_groups_zero_variance"] += dropped
        advantages: dict[str, float] = {}
        if agent:
            advantages["agent/advantage_abs_mean"] = sum(abs(s.advantage) for s in agent) / len(agent)

        scored = self.window.due(self.version)
        designer = designer_advantages(scored, self.baselines)
        if scored:
            counts["designer_rounds"] += len({s.attempt.round_key for s in scored})
        for s in scored:
            counts[f"designer_{s.outcome.value}"] += 1
            if not s.attempt.trainable:
                counts["designer_untrainable"] += 1
            if s.trivially_won:
                counts["designer_trivially_won"] += 1
                logger.warning(
                    "designer sample %s is rescored invalid: %s",
                    s.attempt.sample_id,
                    s.reason,
                    extra={"event": "designer_trivially_won", "env_id": s.attempt.env_id, "spec_id": self.spec.spec_id},
                )
        for s in designer.unscorable:
            code = s.reason_code.value if s.reason_code is not None else "unknown"
            counts[f"designer_unscored/{code}"] += 1
            logger.warning(
                "designer sample %s is not scored (%s): %s",
                s.attempt.sample_id,
                code,
                s.reason,
                extra={"event": "designer_unscored", "reason": code, "spec_id": self.spec.spec_id},
            )
        if designer.advantages:
            counts["designer_trained"] += len(designer.samples)
            counts["designer_zero_advantage"] += sum(
                1 for s, a in designer.advantages if s.attempt.trainable and abs(a) <= 1e-9
            )
        advantages.update(designer.metrics())
        keep = max(self.windows.values()) + self.window.grace + self.settings.max_staleness + 1
        pruned = self.window.prune(self.version, keep)
        if pruned:
            counts["envs_pruned"] += pruned
        batch = agent + designer.samples
        if self.settings.role_normalization:
            batch = normalize_per_role(batch)
        return batch, scored, advantages

    # ------------------------------------------------------------------ the step

    def _execute(self, plan: _Plan) -> tuple[StepMetrics | None, Path | None, Path | None, dict[str, float]]:
        """The collective part of a step, run identically on every rank (in a worker thread).

        The order makes a publication safe: the weights of the version to publish are written,
        then the checkpoint of that version; the caller publishes afterwards. The last item is the
        seconds each part took (``train``, ``weights``, ``checkpoint``; those that ran).
        """
        timings: dict[str, float] = {}
        clock = time.perf_counter()

        def lap(part: str) -> None:
            nonlocal clock
            now = time.perf_counter()
            timings[part] = now - clock
            clock = now

        metrics = self.trainer.train_step(plan.batch) if plan.batch else None
        if plan.batch:
            lap("train")
        weights = written = None
        if plan.publish_version is not None:
            written = self.settings.weights_dir / f"v{plan.publish_version:08d}"
            weights = write_weights(self.trainer.model, written, base_model_dir=self.base_model_dir, world=self.world)
            lap("weights")
        ckpt = None
        if plan.checkpoint_step is not None:
            # The checkpoint of the version just published links its weight files (the same bytes).
            same = written if plan.checkpoint_step == plan.publish_version else None
            model, optimizer = self.trainer.model, self.trainer.optimizer
            ckpt = self.checkpoints.save(plan.checkpoint_step, model, optimizer, plan.state, model_files=same)
            lap("checkpoint")
        return metrics, weights, ckpt, timings

    async def _publish(self, version: int, weights: Path, *, resuming: bool = False) -> PublishResult | None:
        if self.publisher is None:
            return None
        result = await self.publisher.publish(version, weights, resuming=resuming)
        write_json_atomic(self.settings.checkpoint_dir / ANNOUNCED_FILE, {"version": version})
        return result

    async def _finish_pending_publish(self) -> None:
        version = self._pending_publish
        if version is None or self.publisher is None:
            return
        target = self.settings.weights_dir / f"v{version:08d}"
        if not (target / "config.json").is_file():
            await asyncio.to_thread(copy_weights, self.checkpoints.path(version) / "model", target)
        logger.warning("finishing the publication of weight version %d, interrupted before the restart", version)
        await self._publish(version, target, resuming=True)
        self._pending_publish = None

    def _checkpoint_state(self, publish_version: int | None) -> dict[str, Any]:
        assert self.journal is not None
        state = self.state()
        state["journal_from"] = self.journal.rotate()  # everything before is reflected in ``state``
        state["publish_pending"] = publish_version
        return state

    async def run_step(self, stop: asyncio.Event | None = None) -> StepReport:
        """Gather one batch and train on it (see the module docstring).

        Args:
            stop: When set, the fill is abandoned and the step returns untrained (``stopped``).
        """
        if not self.world.is_main:
            raise RuntimeError("run_step runs on rank 0; other ranks call follow()")
        self._step_counts = Counter()
        await self._flush_acks()
        await self._finish_pending_publish()
        started = time.perf_counter()
        if not await self._fill(stop):
            self.totals.update(self._step_counts)
            return StepReport(self.version, False, None, dict(self._step_counts), stopped=True)
        filled = time.perf_counter()
        batch, scored, advantages = self._assemble()
        self._seen = self._held_ids()
        for s in scored:
            if self.on_designer_reward is not None:
                result = self.on_designer_reward(s)
                if inspect.isawaitable(result):
                    await result
        trained = bool(batch)
        behind = staleness(batch, self.version)
        next_version = self.version + 1 if trained else self.version
        publish_version = next_version if trained and next_version % self.settings.publish_every == 0 else None
        if publish_version is not None:
            check_unpublished(self.settings.weights_dir, publish_version)  # before anything is written
        checkpoint_step = (
            next_version
            if trained and (publish_version is not None or next_version % self.settings.checkpoint_every == 0)
            else None
        )
        if trained:
            self.version = next_version
        self._step_counts["trained_samples"] = len(batch)
        self.totals.update(self._step_counts)
        state = self._checkpoint_state(publish_version) if checkpoint_step is not None else self.state()
        plan = _Plan(batch, publish_version, checkpoint_step, state)
        if self.world.distributed:
            await asyncio.to_thread(self.world.broadcast_object, plan)
        assembled = time.perf_counter()
        metrics, weights, ckpt, timings = await asyncio.to_thread(self._execute, plan)
        timings = {"wait": filled - started, "assemble": assembled - filled, **timings}
        if ckpt is not None:
            self._checkpointed = checkpoint_step
            assert self.journal is not None
            self.journal.discard(state["journal_from"])
        publish = None
        if publish_version is not None and weights is not None:
            published = time.perf_counter()
            publish = await self._publish(publish_version, weights)
            timings["publish"] = time.perf_counter() - published
        write_json_atomic(self.settings.checkpoint_dir / "learner_state.json", state)
        self._report_buffer()
        report = StepReport(
            self.version,
            trained,
            metrics,
            dict(self._step_counts),
            scored,
            publish,
            ckpt,
            staleness=behind,
            advantages=advantages,
            timings=timings,
        )
        self._log_step(report, batch)
        return report

    def _log_step(self, report: StepReport, batch: list[TrainSample]) -> None:
        now = time.monotonic()
        if report.trained:
            self._idle_since = now
            fields = {
                "event": "learner_step",
                "spec_id": self.spec.spec_id,
                "version": report.version,
                "groups": report.counters.get("agent_groups", 0),
                "designer_samples": report.counters.get("designer_trained", 0),
                "samples": len(batch),
                "publish": report.publish.version if report.publish is not None else None,
                "checkpoint": str(report.checkpoint) if report.checkpoint is not None else None,
            }
            logger.info(
                "learner_step %s", json.dumps({**fields, **report.flat_metrics()}, sort_keys=True), extra=fields
            )
        elif now - self._last_wait_log >= self.settings.wait_log_s:
            self._last_wait_log = now
            waited = now - self._idle_since
            logger.info(
                "learner waiting for samples: %d of %d agent groups complete, %d plays buffered, %d designer samples "
                "waiting for their windows; %.0f s since the last trained step (version %d)",
                len(self._complete_groups()),
                self.settings.agent_groups_per_step,
                sum(len(v) for v in self.groups.values()),
                len(self.window.pending),
                waited,
                self.version,
                extra={"event": "waiting", "for": "samples", "waited_s": round(waited), "spec_id": self.spec.spec_id},
            )

    async def checkpoint_now(self) -> Path | None:
        """Checkpoint the current state (at a stop): a new checkpoint when the version moved, else its state.

        Returns the checkpoint's path (``None`` when nothing was trained or received yet: the journal
        already holds every received sample).
        """
        assert self.journal is not None
        path: Path | None
        if self._checkpointed is not None and self._checkpointed == self.version:
            state = self._checkpoint_state(self._pending_publish)
            path = self.checkpoints.update_state(self.version, state)
        elif self.version > (self._checkpointed or 0):
            state = self._checkpoint_state(self._pending_publish)
            plan = _Plan([], None, self.version, state)
            if self.world.distributed:
                await asyncio.to_thread(self.world.broadcast_object, plan)
            path = (await asyncio.to_thread(self._execute, plan))[2]
            self._checkpointed = self.version
        else:
            return None
        self.journal.discard(state["journal_from"])
        write_json_atomic(self.settings.checkpoint_dir / "learner_state.json", state)
        logger.info("checkpointed version %d at %s", self.version, path, extra={"event": "checkpoint"})
        return path

    async def run(self, max_steps: int | None = None, stop: asyncio.Event | None = None) -> list[StepReport]:
        """Step until ``max_steps`` trained steps or ``stop`` is set; returns every step's report.

        A stop request abandons the step being filled (a training step in flight finishes), then the
        state is checkpointed.
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
            if self.world.distributed:
                await asyncio.to_thread(self.world.broadcast_object, _Plan([], None, None, {}, stop=True))
            if self.journal is not None:
                self.journal.close()
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
