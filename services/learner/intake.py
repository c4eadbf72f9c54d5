"""Intake: the learner's streams drained into the sample journal and the buffer (rank 0).

The learner consumes ``envs.audited``, ``samples.designer`` and ``samples.agent``. Each poll's
messages are appended to the sample journal and fsynced, then acknowledged at once
(``journal.py``): the queue re-delivers only what never reached the journal, i.e. only after a
crash. Samples of another run spec are refused (acknowledged, counted as ``refused_spec``, logged
with the reason once per foreign spec). Every play goes into its env's window accumulator by slot
and, unless hinted, into its advantage group (one env, one window slot, one arm); designer samples
and the rollout's audit verdicts wait in the window (``core/window.py``). A malformed message is
counted and dropped, never blocks the stream.

What the buffer holds is decided on by ``core/plan.py``; ``apply`` removes what a step took.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Mapping
from typing import Any

from google.protobuf.message import DecodeError

from services.learner.buffer import LearnerBuffer, write_buffer
from services.learner.core.batching import AgentPlaySample, BatchError
from services.learner.core.plan import StepPlan, complete_groups
from services.learner.core.window import DesignerWindow
from services.learner.journal import JournalRecord, SampleJournal
from services.learner.samples import (
    agent_play,
    agent_train_sample,
    designer_attempt,
    env_audit,
    play_sample_from_json,
    play_sample_to_json,
)
from services.learner.settings import LearnerSettings
from spade.envs.types import Setting
from spade.queues.base import ENVS_AUDITED, SAMPLES_AGENT, SAMPLES_DESIGNER, WorkQueue
from spade.runspec import RunSpec
from spade.serving.logs import get_logger, log_event
from spade.v1 import queues_pb2

logger = get_logger(__name__)

STREAMS = (ENVS_AUDITED, SAMPLES_DESIGNER, SAMPLES_AGENT)
"""Polled in this order: an env's verdict and designer sample before the plays that complete its window."""


def designer_window(settings: LearnerSettings, spec: RunSpec, data: Mapping[str, Any] | None = None) -> DesignerWindow:
    """The designer window under the run spec's windows and rewards (restored from ``data`` when given)."""
    return DesignerWindow.from_json(
        dict(data) if data is not None else {"plays": {}, "pending": []},
        {Setting.GAME: spec.window_versions_game, Setting.TOOL: spec.window_versions_tool},
        spec.rewards.to_config(),
        group_size=spec.group_size,
        grace=settings.window_grace_versions,
        first_play_grace=settings.first_play_grace_versions,
        await_audit=spec.audit_plays > 0,
    )


class Intake:
    """Drains the queue into the journal and the buffer (see the module docstring).

    Args:
        settings: Learner settings (consumer group and name, ``train_on_hinted``, the window's graces).
        spec: The run spec (its id is checked on every message).
        queue: The work queue.
        journal: The sample journal.

    Attributes:
        groups: Buffered agent plays by advantage group, in arrival order.
        window: The designer window (plays by slot, pending designer attempts, audit verdicts).
        counts: This step's counts (received, duplicates, refused, malformed, ...; ``take_counts``).
    """

    def __init__(self, settings: LearnerSettings, spec: RunSpec, queue: WorkQueue, journal: SampleJournal) -> None:
        self.settings = settings
        self.spec = spec
        self.queue = queue
        self.journal = journal
        self.window = designer_window(settings, spec)
        self.groups: dict[str, list[AgentPlaySample]] = {}
        self.counts: Counter[str] = Counter()
        self._seen: set[str] = set()
        self._to_ack: list[tuple[str, str]] = []
        self._foreign_specs: set[str] = set()

    # ------------------------------------------------------------------ the buffer

    def groups_to_json(self) -> dict[str, list[dict[str, Any]]]:
        """The buffered groups as JSON data (``restore`` reads them back)."""
        return {k: [play_sample_to_json(p) for p in v] for k, v in self.groups.items()}

    def restore(self, window: Mapping[str, Any], groups: Mapping[str, list[dict[str, Any]]]) -> None:
        """Replace the buffer with a checkpoint's (``DesignerWindow.to_json`` and ``groups_to_json`` output)."""
        self.window = designer_window(self.settings, self.spec, window)
        self.groups = {k: [play_sample_from_json(p) for p in v] for k, v in groups.items()}
        self._seen = self._held_ids()

    def complete_groups(self) -> list[str]:
        """The groups holding G plays."""
        return complete_groups(self.groups, self.spec.group_size)

    def apply(self, plan: StepPlan, version: int) -> int:
        """Remove what a step took or dropped; returns how many envs' old accumulators were pruned.

        The trained and dropped groups leave the buffer, the scored designer attempts the window, and
        accumulators of envs no attempt waits for, last played long enough before ``version``, are
        pruned. A sample id no longer held may be received again.
        """
        for key in [*plan.trained, *plan.dropped]:
            del self.groups[key]
        self.window.release(plan.scored)
        k = max(self.spec.window_versions_game, self.spec.window_versions_tool)
        pruned = self.window.prune(version, k + self.window.grace + self.settings.max_staleness + 1)
        self._seen = self._held_ids()
        return pruned

    def take_counts(self) -> Counter[str]:
        """This step's counts so far, which then start again from zero."""
        counts, self.counts = self.counts, Counter()
        return counts

    def report(self, version: int) -> None:
        """Write the buffer record ``spade cluster status`` shows (``buffer.py``); a failure is only logged."""
        try:
            write_buffer(
                self.settings.checkpoint_dir,
                LearnerBuffer(
                    version=version,
                    spec_id=self.spec.spec_id,
                    plays_buffered=sum(len(v) for v in self.groups.values()),
                    groups_complete=len(self.complete_groups()),
                    groups_per_step=self.settings.agent_groups_per_step,
                    group_size=self.spec.group_size,
                    designer_waiting=len(self.window.pending),
                    updated_at=time.time(),
                ),
            )
        except OSError as exc:
            logger.warning("could not write the buffer record: %s", exc)

    def _held_ids(self) -> set[str]:
        return {p.sample.sample_id for v in self.groups.values() for p in v} | set(self.window.pending)

    # ------------------------------------------------------------------ draining the queue

    async def fill(self, stop: asyncio.Event | None, version: int) -> bool:
        """Poll until a step's groups are complete or ``fill_timeout_s`` passed; ``False`` when told to stop.

        ``version`` is the learner's, for the buffer record written after each poll that received anything.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.fill_timeout_s
        while True:
            if stop is not None and stop.is_set():
                return False
            remaining_ms = int(max(0.0, deadline - loop.time()) * 1000)
            if await self.poll(block_ms=min(1000, max(1, remaining_ms))):
                self.report(version)
            if len(self.complete_groups()) >= self.settings.agent_groups_per_step:
                return True
            if loop.time() >= deadline:
                return True

    async def poll(self, block_ms: int) -> int:
        """One round over the streams: journal, accept and acknowledge what came; returns how many messages."""
        got = 0
        for stream in STREAMS:
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
                    self.counts["redelivered"] += 1
                self.accept(d.stream, d.payload)
                self._to_ack.append((d.stream, d.message_id))
            await self.flush_acks()
            got += len(deliveries)
        return got

    async def flush_acks(self) -> None:
        """Acknowledge what is in the journal (after a replay, or a poll an ack failure cut short)."""
        while self._to_ack:
            stream, message_id = self._to_ack[0]
            await self.queue.ack(stream, self.settings.consumer_group, message_id)
            self._to_ack.pop(0)

    def replay(self, journal_from: int) -> int:
        """Accept the journal's messages from segment ``journal_from`` on; returns how many.

        They are acknowledged at the next ``flush_acks`` (a crash may have cut their acknowledgement short).
        """
        replayed = 0
        for record in self.journal.replay(journal_from):
            self.accept(record.stream, record.payload)
            self._to_ack.append((record.stream, record.message_id))
            replayed += 1
        if replayed:
            logger.info(
                "replayed %d messages from the sample journal (received after the checkpoint): %s",
                replayed,
                dict(self.counts),
            )
        return replayed

    def accept(self, stream: str, payload: bytes) -> None:
        """Take one message into the buffer (or count why not)."""
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
            self.counts["malformed"] += 1
            logger.error("dropping a malformed message on %s: %s", stream, exc)

    def _same_spec(self, spec_id: str, sample_id: str, role: str) -> bool:
        if spec_id == self.spec.spec_id:
            return True
        self.counts["refused_spec"] += 1
        message = (
            f"refusing {role} sample {sample_id}: made under run spec {spec_id or '(none)'!r} but this learner "
            f"runs spec {self.spec.spec_id!r} (acknowledged, counted as refused_spec, never trained); every "
            "service of a run must read one spec (`spade runspec show`)"
        )
        if spec_id not in self._foreign_specs:
            self._foreign_specs.add(spec_id)
            log_event(logger, "sample_refused", message, level=logging.ERROR, reason="spec_mismatch", spec_id=spec_id)
        else:
            logger.debug(message)
        return False

    def _accept_audit(self, msg: queues_pb2.EnvAudit) -> None:
        audit = env_audit(msg)
        if not self.window.record_audit(audit):
            self.counts["duplicates"] += 1
            return
        self.counts["audits_received"] += 1
        if audit.trivially_won:
            self.counts["audits_trivially_won"] += 1

    def _accept_designer(self, msg: queues_pb2.DesignerSample) -> None:
        if msg.sample_id in self._seen or not self.window.add_attempt(designer_attempt(msg)):
            self.counts["duplicates"] += 1
            return
        self._seen.add(msg.sample_id)
        self.counts["designer_received"] += 1

    def _accept_agent(self, msg: queues_pb2.AgentSample) -> None:
        counts = self.counts
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
            counts[f"resource_fault/{play.finish_reason}"] += 1
        if agent_sample is not None:
            self.groups.setdefault(agent_sample.group_key, []).append(agent_sample)
