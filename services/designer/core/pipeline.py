"""What happens to a designer answer once it exists: parse, repair, validate, judge, store, announce.

The policy's designer (``core/loop.py``) and the pool designer (``core/pool.py``) differ only in where
an answer comes from; from the answer on, both run this pipeline:

parse (one ```` ```python ```` block, then ``### HINT`` and the hint) → repair → sandbox validation
within the agent's turn budget → ``criteria_reachable`` (tool setting, optional) → store through
the memory (dedup; invalid envs kept with their report) → ``EnvReady`` (valid and new only) →
``DesignerSample`` (every attempt with output) → ``RecordAttempts`` in the memory (so validity
figures count malformed answers) → one structured log line.

An outage of the sandbox, the memory or the queue is ``INFRA_FAILED``: not the designer's fault, no
sample. Everything else the answer is answerable for.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

from services.designer.core.attempt import DUPLICATE_CHECK, AttemptOutcome, AttemptRecord, to_designer_sample
from services.designer.core.parsing import ParseFailure, parse_output
from services.designer.core.ports import EnvironmentMemory, EnvironmentRecord, EnvReady, Outbox, Validator
from services.designer.core.reachability import CriteriaReachable
from spade.envs.types import CheckResult, Setting
from spade.serving.logs import get_logger, log_event

log = get_logger(__name__)

#: The ``event`` field of the one log line per attempt.
ATTEMPT_EVENT = "designer_attempt"


class SeedDeriver(Protocol):
    """The sampling seed of one generation of the designer: (round, slot, attempt, purpose, turn)."""

    def __call__(self, round_index: int, slot: int, attempt: int, purpose: str, turn: int) -> int: ...


@dataclass(frozen=True)
class PipelineConfig:
    """The pipeline's knobs.

    Attributes:
        setting: ``"game"`` or ``"tool"``.
        spec_id: The run spec (carried by every sample, announcement and log line).
        agent_max_turns: The agent's turn budget: validation replays ``solution()`` within it.
        max_hint_chars: Hints are cut to this many characters.
        max_new_tokens: The generation cap (named when a malformed answer hit it).
        publish_timeout_s: How long a publish waits for room in a full queue.
    """

    setting: str = Setting.GAME
    spec_id: str = ""
    agent_max_turns: int = 25
    max_hint_chars: int = 2000
    max_new_tokens: int = 2048
    publish_timeout_s: float = 30.0


def log_attempt(record: AttemptRecord) -> None:
    """The one structured line per attempt (outcome, failed check, skill, round, spec id, ...)."""
    fields = {
        "outcome": record.label,
        "failed_check": record.failed_check,
        "skill": record.skill,
        "round": record.batch_id,
        "round_index": record.round_index,
        "slot": record.slot,
        "attempt": record.attempt,
        "sample_id": record.sample_id,
        "env_id": record.env_id,
        "spec_id": record.spec_id,
        "setting": record.setting,
        "weight_version": record.weight_version,
        "trainable": record.trainable,
        "constrained": record.constrained,
        "error": record.error,
    }
    level = logging.WARNING if not record.outcome.yields_sample else logging.INFO
    stored = f" [{record.env_id}]" if record.env_id else ""
    text = (
        f"designer attempt {record.sample_id[:12]}: {record.label}{stored} (round {record.batch_id} slot "
        f"{record.slot} attempt {record.attempt}, {record.skill}, spec {record.spec_id or '-'})"
        + (f": {record.error}" if record.error else "")
    )
    log_event(log, ATTEMPT_EVENT, text, level=level, **fields)


class AttemptPipeline:
    """Finishes answers (see the module docstring).

    Args:
        config: The pipeline's knobs.
        validator: The sandbox validation pipeline.
        memory: The environment memory (storage, dedup, attempt records).
        outbox: ``envs.ready`` and ``samples.designer``.
        repair: The known code repairs (``spade.envs.repair.repair_code``); identity when ``None``.
        extract: Code extraction from the part of the answer before the hint.
        reachability: The ``criteria_reachable`` check (tool setting); ``None``: not run.
        seeds: Sampling seeds of the check's generations; ``None``: unseeded.
    """

    def __init__(
        self,
        config: PipelineConfig,
        *,
        validator: Validator,
        memory: EnvironmentMemory,
        outbox: Outbox,
        repair: Callable[[str], str] | None = None,
        extract: Callable[[str], str] | None = None,
        reachability: CriteriaReachable | None = None,
        seeds: SeedDeriver | None = None,
    ) -> None:
        self.config = config
        self._validator = validator
        self._memory = memory
        self._outbox = outbox
        self._repair = repair or (lambda code: code)
        self._extract = extract
        self._reachability = reachability if config.setting == Setting.TOOL else None
        self._seeds = seeds

    async def finish(self, record: AttemptRecord) -> AttemptRecord:
        """Take an answer (``record.text``) through the pipeline; returns the finished record."""
        record = await self._finish(record)
        if record.outcome.yields_sample:
            try:
                await self._memory.record_attempts([record.summary()])
            except Exception as error:
                # The sample is out and the env stored; only the memory's validity count misses it.
                log.error("recording designer attempt %s in the memory failed: %s", record.sample_id, error)
        log_attempt(record)
        return record

    def give_up(self, record: AttemptRecord) -> AttemptRecord:
        """An attempt that produced no answer (``GENERATION_FAILED``): its log line, nothing else."""
        log_attempt(record)
        return record

    async def _finish(self, record: AttemptRecord) -> AttemptRecord:
        config = self.config
        parsed = parse_output(record.text, max_hint_chars=config.max_hint_chars, extract=self._extract)
        if isinstance(parsed, ParseFailure):
            detail = parsed.detail
            if record.finish_reason == "length":
                detail += f" (the answer hit max_new_tokens={config.max_new_tokens})"
            failed = CheckResult(parsed.check, False, detail)
            malformed = replace(record, outcome=AttemptOutcome.MALFORMED, checks=(failed,))
            return await self._publish(malformed)
        record = replace(record, code=self._repair(parsed.code), hint=parsed.hint)
        try:
            report = await self._validator.validate(record.code, config.setting, agent_max_turns=config.agent_max_turns)
        except Exception as error:
            log.error("sandbox validation failed for sample %s: %s", record.sample_id, error)
            return replace(
                record, outcome=AttemptOutcome.INFRA_FAILED, error=f"validator: {type(error).__name__}: {error}"
            )
        checks = tuple(report.checks)
        if not report.valid and all(c.passed for c in checks):
            checks = (*checks, CheckResult("validation", False, "the validator rejected the code"))
        record = replace(record, code=report.repaired_code or record.code, checks=checks)
        valid = report.valid
        if valid and self._reachability is not None:
            try:
                judged = await self._reachability.check(record.code, seeds=self._judge_seeds(record))
            except Exception as error:
                log.error("criteria_reachable could not ask the policy for sample %s: %s", record.sample_id, error)
                return replace(
                    record,
                    outcome=AttemptOutcome.INFRA_FAILED,
                    error=f"criteria_reachable: {type(error).__name__}: {error}",
                )
            checks = (*checks, judged)
            valid = judged.passed
            record = replace(record, checks=checks)
        env = EnvironmentRecord(
            valid=valid,
            setting=record.setting,
            skill=record.skill,
            code=record.code,
            hint=record.hint,
            env_class=report.env_class,
            checks=checks,
            weight_version=record.weight_version,
            designer_sample_id=record.sample_id,
            batch_id=record.batch_id,
            source=record.source,
        )
        if not valid:
            # Invalid envs are kept with their report for inspection; failing to keep one loses
            # nothing the learner needs (an invalid attempt scores 0), so the sample still goes out.
            try:
                stored = await self._memory.store(env)
                record = replace(record, env_id="" if stored.duplicate else stored.env_id)
            except Exception as error:
                log.warning("storing invalid env of sample %s failed: %s", record.sample_id, error)
            return await self._publish(replace(record, outcome=AttemptOutcome.INVALID))
        try:
            stored = await self._memory.store(env)
        except Exception as error:
            log.error("memory store failed for sample %s: %s", record.sample_id, error)
            return replace(
                record, outcome=AttemptOutcome.INFRA_FAILED, error=f"memory: {type(error).__name__}: {error}"
            )
        if stored.duplicate:
            duplicate = CheckResult(DUPLICATE_CHECK, False, f"equivalent to stored env {stored.env_id}")
            return await self._publish(replace(record, outcome=AttemptOutcome.DUPLICATE, checks=(*checks, duplicate)))
        return await self._publish(replace(record, outcome=AttemptOutcome.VALID, env_id=stored.env_id))

    def _judge_seeds(self, record: AttemptRecord) -> list[int | None]:
        if self._reachability is None:
            return []
        tries = self._reachability.config.tries
        if self._seeds is None:
            return [None] * tries
        return [
            self._seeds(record.round_index, record.slot, record.attempt, "criteria_reachable", turn)
            for turn in range(tries)
        ]

    async def _publish(self, record: AttemptRecord) -> AttemptRecord:
        """Announce the env (when valid) and publish the designer sample; an outage becomes ``INFRA_FAILED``."""
        timeout = self.config.publish_timeout_s
        if record.outcome is AttemptOutcome.VALID:
            ready = EnvReady(
                env_id=record.env_id,
                setting=record.setting,
                skill=record.skill,
                weight_version=record.weight_version,
                designer_sample_id=record.sample_id,
                spec_id=record.spec_id,
            )
            try:
                await self._outbox.publish_env_ready(ready, timeout_s=timeout)
            except Exception as error:
                # The env stays in the memory; without EnvReady nobody plays it, so no sample either.
                log.error("enqueueing env %s failed: %s", record.env_id, error)
                return replace(record, outcome=AttemptOutcome.INFRA_FAILED, error=f"queue: {error}")
        sample = to_designer_sample(record)
        try:
            await self._outbox.publish_sample(sample, timeout_s=timeout)
        except Exception as error:
            log.error("publishing designer sample %s failed: %s", record.sample_id, error)
            return replace(record, error=f"queue: designer sample not published: {error}")
        return record
