"""The designer loop: N environments per regeneration, bounded concurrency, nothing finished lost.

Per attempt: pick a new corpus document → fetch memory examples → build and fit the prompt →
generate (token ids + logprobs) → parse code + hint → repair → validate in the sandbox → store
through the memory (dedup) → announce ``EnvReady`` through the outbox (``envs.ready``); every
attempt with output becomes a ``DesignerSample`` through the outbox (``samples.designer``).

A batch has ``envs_per_batch`` slots, one skill each (rotated); a slot retries up to
``max_attempts_per_env`` times until one attempt is valid. At most ``concurrency`` attempts run at
once. The batch deadline stops new generations and cancels running ones, but an attempt whose
output was already generated is always validated, stored and published: finished work is kept
(the reference discarded every finished environment when its 900 s timeout fired).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from services.designer.core.attempt import DUPLICATE_CHECK, AttemptOutcome, AttemptRecord, to_designer_sample
from services.designer.core.parsing import ParseFailure, parse_output
from services.designer.core.ports import (
    Check,
    EnvironmentMemory,
    EnvironmentRecord,
    EnvReady,
    MemoryExamples,
    Outbox,
    PolicyLLM,
    Sampling,
    Validator,
)
from services.designer.core.prompts import ExampleEnv, PromptParts, fit_prompt, truncate_words
from services.designer.core.skills import Skill, assign_skills, skills_for

log = logging.getLogger(__name__)


class DocumentLike(Protocol):
    """A corpus document: text for the prompt, metadata for lineage."""

    @property
    def text(self) -> str: ...

    @property
    def metadata(self) -> dict[str, object]: ...


class DocumentSource(Protocol):
    """Hands out a new corpus document per attempt (``CorpusSampler``)."""

    def next_document(self) -> DocumentLike: ...


@dataclass(frozen=True)
class DesignerConfig:
    """The loop's knobs (built from ``DesignerSettings`` by the wiring).

    Attributes:
        setting: ``"game"`` or ``"tool"``.
        envs_per_batch: Environment slots per regeneration batch.
        max_attempts_per_env: Attempts per slot before giving it up.
        concurrency: Attempts in flight at once.
        batch_timeout_s: Deadline for a batch; finished work is kept when it fires.
        sampling: Sampling parameters of each generation.
        max_prompt_tokens: Token budget of the chat-templated prompt.
        doc_max_words: Corpus documents are cut to this many words.
        doc_min_words: The budget halves the document down to this before dropping memory examples.
        n_positive: Memory positives per prompt.
        n_negative: Memory negatives per prompt.
        excerpt_chars: Memory code excerpts are cut to this many characters.
        max_hint_chars: Hints are cut to this many characters.
        publish_timeout_s: How long a publish waits for room in a full queue.
    """

    setting: str = "game"
    envs_per_batch: int = 6
    max_attempts_per_env: int = 2
    concurrency: int = 2
    batch_timeout_s: float = 900.0
    sampling: Sampling = field(default_factory=lambda: Sampling(max_new_tokens=2048))
    max_prompt_tokens: int = 5632
    doc_max_words: int = 600
    doc_min_words: int = 100
    n_positive: int = 2
    n_negative: int = 1
    excerpt_chars: int = 1200
    max_hint_chars: int = 2000
    publish_timeout_s: float = 30.0


@dataclass(frozen=True)
class BatchResult:
    """What one regeneration batch produced.

    Attributes:
        batch_id: Its id (carried by every designer sample of the batch).
        records: Every finished attempt, in completion order.
        timed_out: Whether the deadline cut the batch short.
    """

    batch_id: str
    records: tuple[AttemptRecord, ...]
    timed_out: bool

    @property
    def env_ids(self) -> list[str]:
        """Ids of the new environments."""
        return [r.env_id for r in self.records if r.outcome is AttemptOutcome.VALID]

    @property
    def outcomes(self) -> Counter[str]:
        """Attempt count per outcome."""
        return Counter(r.outcome.value for r in self.records)

    @property
    def validity_rate(self) -> float:
        """Valid attempts over attempts with output (0.0 when none)."""
        trainable = [r for r in self.records if r.outcome.trainable]
        if not trainable:
            return 0.0
        return sum(r.outcome is AttemptOutcome.VALID for r in trainable) / len(trainable)


class Designer:
    """Runs regeneration batches for one setting.

    Args:
        config: Loop settings.
        llm: The policy.
        validator: The sandbox validation pipeline.
        memory: The environment memory (examples, dedup, storage).
        outbox: Where new environments and designer samples go (``envs.ready``, ``samples.designer``).
        documents: A new corpus document per attempt.
        examples: Example environments of the setting; attempts rotate through them.
        repair: The known code repairs (``spade.envs.repair.repair_code``); identity when ``None``.
        extract: Code extraction from the part of the answer before the hint.
    """

    def __init__(
        self,
        config: DesignerConfig,
        *,
        llm: PolicyLLM,
        validator: Validator,
        memory: EnvironmentMemory,
        outbox: Outbox,
        documents: DocumentSource,
        examples: Sequence[ExampleEnv] = (),
        repair: Callable[[str], str] | None = None,
        extract: Callable[[str], str] | None = None,
    ) -> None:
        skills_for(config.setting)  # fail fast on an unknown setting
        self.config = config
        self._llm = llm
        self._validator = validator
        self._memory = memory
        self._outbox = outbox
        self._documents = documents
        self._examples = tuple(examples)
        self._repair = repair or (lambda code: code)
        self._extract = extract
        self._attempts_started = 0
        self._batches = 0

    async def run_batch(self, *, batch_index: int | None = None) -> BatchResult:
        """Design ``envs_per_batch`` environments; returns every finished attempt.

        Args:
            batch_index: Drives the skill rotation; defaults to the number of batches run so far.
        """
        config = self.config
        index = self._batches if batch_index is None else batch_index
        self._batches += 1
        batch_id = uuid.uuid4().hex
        skills = assign_skills(config.setting, config.envs_per_batch, batch_index=index)
        records: list[AttemptRecord] = []
        finishing: set[asyncio.Task[AttemptRecord]] = set()
        gate = asyncio.Semaphore(config.concurrency)

        async def slot_task(slot: int, skill: Skill) -> None:
            for attempt in range(config.max_attempts_per_env):
                async with gate:
                    record = await self._attempt(batch_id, slot, attempt, skill, finishing)
                records.append(record)
                if record.outcome is AttemptOutcome.VALID:
                    return

        tasks = [asyncio.create_task(slot_task(slot, skill)) for slot, skill in enumerate(skills)]
        timed_out = False
        if tasks:
            try:
                _, pending = await asyncio.wait(tasks, timeout=config.batch_timeout_s)
            except asyncio.CancelledError:
                # The caller gave up on the batch: stop the slots (attempts already generated still
                # finish and publish on their own, shielded).
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise
            if pending:
                timed_out = True
                log.warning(
                    "designer batch %s hit its %.0f s deadline: cancelling %d unfinished slots, "
                    "keeping finished attempts",
                    batch_id,
                    config.batch_timeout_s,
                    len(pending),
                )
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
        # Outputs generated before the deadline are validated, stored and published regardless.
        for finish in list(finishing):
            try:
                late = await finish
            except Exception:
                log.exception("finishing a designer attempt failed")
                continue
            if late.sample_id not in {r.sample_id for r in records}:
                records.append(late)
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        result = BatchResult(batch_id=batch_id, records=tuple(records), timed_out=timed_out)
        log.info("designer batch %s: %s", batch_id, dict(result.outcomes))
        return result

    async def _attempt(
        self,
        batch_id: str,
        slot: int,
        attempt: int,
        skill: Skill,
        finishing: set[asyncio.Task[AttemptRecord]],
    ) -> AttemptRecord:
        config = self.config
        document = self._documents.next_document()
        example = self._examples[self._attempts_started % len(self._examples)] if self._examples else None
        self._attempts_started += 1
        memory = await self._memory_examples(skill)
        parts = PromptParts(
            setting=config.setting,
            skill=skill,
            document=truncate_words(document.text, config.doc_max_words),
            example=example,
            memory=memory,
            excerpt_chars=config.excerpt_chars,
        )
        fitted = fit_prompt(
            parts,
            self._llm.apply_chat_template,
            max_prompt_tokens=config.max_prompt_tokens,
            doc_min_words=config.doc_min_words,
        )
        record = AttemptRecord(
            sample_id=uuid.uuid4().hex,
            batch_id=batch_id,
            slot=slot,
            attempt=attempt,
            setting=config.setting,
            skill=skill.name,
            outcome=AttemptOutcome.GENERATION_FAILED,
            prompt_ids=tuple(fitted.prompt_ids),
            prompt_messages=tuple(fitted.messages),
            source=dict(document.metadata),
        )
        try:
            generation = await self._llm.generate(list(fitted.prompt_ids), config.sampling)
        except asyncio.CancelledError:
            raise
        except Exception as error:
            log.warning("designer generation failed (batch %s slot %d): %s", batch_id, slot, error)
            return replace(record, error=f"{type(error).__name__}: {error}")
        record = replace(
            record,
            output_ids=tuple(generation.output_ids),
            logprobs=tuple(generation.logprobs),
            weight_version=int(generation.weight_version),
            finish_reason=generation.finish_reason,
            text=generation.text,
        )
        # From here on the output exists: finish it even if the batch deadline cancels this slot.
        finish = asyncio.create_task(self._finish(record))
        finishing.add(finish)
        return await asyncio.shield(finish)

    async def _memory_examples(self, skill: Skill) -> MemoryExamples:
        config = self.config
        if config.n_positive == 0 and config.n_negative == 0:
            return MemoryExamples()
        try:
            return await self._memory.sample_examples(config.setting, skill.name, config.n_positive, config.n_negative)
        except Exception as error:
            # A prompt without memory examples is still a good prompt; an outage must not stop design.
            log.warning("memory examples unavailable, designing without them: %s", error)
            return MemoryExamples()

    async def _finish(self, record: AttemptRecord) -> AttemptRecord:
        """Parse, repair, validate, store and publish one generated answer."""
        config = self.config
        parsed = parse_output(record.text, max_hint_chars=config.max_hint_chars, extract=self._extract)
        if isinstance(parsed, ParseFailure):
            detail = parsed.detail
            if record.finish_reason == "length":
                detail += f" (the answer hit max_new_tokens={config.sampling.max_new_tokens})"
            malformed = replace(record, outcome=AttemptOutcome.MALFORMED, checks=(Check(parsed.check, False, detail),))
            return await self._publish(malformed)
        record = replace(record, code=self._repair(parsed.code), hint=parsed.hint)
        try:
            report = await self._validator.validate(record.code, config.setting)
        except Exception as error:
            log.error("sandbox validation failed for sample %s: %s", record.sample_id, error)
            return replace(
                record, outcome=AttemptOutcome.INFRA_FAILED, error=f"validator: {type(error).__name__}: {error}"
            )
        checks = report.checks
        if not report.valid and all(c.passed for c in checks):
            checks = (*checks, Check("validation", False, "the validator rejected the code"))
        record = replace(record, code=report.repaired_code or record.code, checks=checks)
        env = EnvironmentRecord(
            valid=report.valid,
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
        if not report.valid:
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
            duplicate = Check(DUPLICATE_CHECK, False, f"equivalent to stored env {stored.env_id}")
            return await self._publish(replace(record, outcome=AttemptOutcome.DUPLICATE, checks=(*checks, duplicate)))
        return await self._publish(replace(record, outcome=AttemptOutcome.VALID, env_id=stored.env_id))

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
