"""The policy's designer: rounds of ``envs_per_round`` environments over ``skills_per_round`` skills.

Per attempt: pick a new corpus document → fetch memory examples → build the prompt (the contract,
the agent's budget, an example, the document, memory examples, the skill) and fit it to the token
budget → generate (token ids + logprobs; seeded from (run, round, slot, attempt); constrained to
the answer format when structured output is on) → the answer pipeline (``core/pipeline.py``:
parse, repair, validate, judge, store, announce, sample, record).

A round (``batch_id`` = round id) has ``envs_per_round`` slots whose skills rotate as the paper's
(``core/skills.py``); a slot retries up to ``max_attempts_per_env`` times until one attempt is
valid; at most ``concurrency`` generations run at once. The round's deadline and a stop request end
it early without losing finished work (``core/rounds.py``).

**Attempts at once.** A slot's attempts are independent until validation (each has its own document,
example and seed), so with ``attempts_at_once`` = k a slot generates its next k attempts together
instead of waiting for each one to fail before the next starts. Their answers are still finished
(validated, stored, published, sampled) one by one in attempt order, and once one is valid the rest
are cancelled or, if already generated, discarded unseen: the slot's samples are exactly the
attempts the one-at-a-time loop would have made (the same prefix, up to the first valid), so the
designer's reward is what it would be; only compute is spent on the discarded ones. ``1`` is the
paper's loop, a retry after each failure.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from services.designer.core.attempt import AttemptOutcome, AttemptRecord
from services.designer.core.pipeline import AttemptPipeline, SeedDeriver
from services.designer.core.ports import EnvironmentMemory, MemoryExamples, PolicyLLM, Sampling
from services.designer.core.prompts import AgentBudget, ExampleEnv, PromptParts, fit_prompt, truncate_words
from services.designer.core.rounds import BatchResult, RoundState, new_round_id, run_slots
from services.designer.core.skills import Skill, assign_round, skills_for
from spade.envs.types import Setting
from spade.serving.logs import get_logger

__all__ = ["BatchResult", "Designer", "DesignerConfig", "DocumentLike", "DocumentSource"]

log = get_logger(__name__)


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
    """The loop's knobs (built from ``DesignerSettings`` and the run spec by the wiring).

    Attributes:
        setting: ``"game"`` or ``"tool"``.
        envs_per_round: Environment slots per round (run spec).
        skills_per_round: Skills of the setting's six used per round (run spec).
        max_attempts_per_env: Attempts per slot before giving it up.
        attempts_at_once: A slot's attempts generated together (module docstring); 1: one after another.
        concurrency: Generations in flight at once (over all slots).
        batch_timeout_s: Deadline for a round; finished work is kept when it fires.
        grace_s: After a stop request, how long answers already generated may take to be finished.
        sampling: Sampling parameters of each generation (``regex`` set: structured output).
        budget: The agent's budget the prompt states (run spec).
        spec_id: The run spec's id.
        trainable: False for a frozen designer: its samples are scored, never trained on.
        max_prompt_tokens: Token budget of the chat-templated prompt.
        doc_max_words: Corpus documents are cut to this many words.
        doc_min_words: The budget halves the document down to this before dropping it.
        n_positive: Memory positives per prompt.
        n_negative: Memory negatives per prompt.
        excerpt_chars: Memory code excerpts are cut to this many characters.
    """

    setting: str = Setting.GAME
    envs_per_round: int = 6
    skills_per_round: int = 3
    max_attempts_per_env: int = 2
    attempts_at_once: int = 1
    concurrency: int = 2
    batch_timeout_s: float = 900.0
    grace_s: float = 20.0
    sampling: Sampling = field(default_factory=lambda: Sampling(max_new_tokens=2048))
    budget: AgentBudget = field(default_factory=AgentBudget)
    spec_id: str = ""
    trainable: bool = True
    max_prompt_tokens: int = 5632
    doc_max_words: int = 600
    doc_min_words: int = 100
    n_positive: int = 2
    n_negative: int = 1
    excerpt_chars: int = 1200


class Designer:
    """Runs regeneration rounds for one setting with the policy.

    Args:
        config: Loop settings.
        llm: The policy.
        pipeline: What happens to each answer (validation, storage, announcement, samples).
        memory: The environment memory (examples for prompts).
        documents: A new corpus document per attempt.
        examples: Example environments of the setting; attempts rotate through them.
        seeds: Sampling seeds from (round, slot, attempt); ``None``: unseeded generations.
    """

    def __init__(
        self,
        config: DesignerConfig,
        *,
        llm: PolicyLLM,
        pipeline: AttemptPipeline,
        memory: EnvironmentMemory,
        documents: DocumentSource,
        examples: Sequence[ExampleEnv] = (),
        seeds: SeedDeriver | None = None,
    ) -> None:
        skills_for(config.setting)  # fail fast on an unknown setting
        self.config = config
        self._llm = llm
        self._pipeline = pipeline
        self._memory = memory
        self._documents = documents
        self._examples = tuple(examples)
        self._seeds = seeds
        self._attempts_started = 0
        self._next_round = 0

    async def run_batch(
        self, *, round_index: int | None = None, stop: asyncio.Event | None = None, weight_version: int = -1
    ) -> BatchResult:
        """Design one round of ``envs_per_round`` environments; returns every finished attempt.

        Args:
            round_index: The round (drives its skills and seeds); defaults to the one after the last.
            stop: Set to end the round early (SIGTERM): unfinished slots are cancelled, answers
                already generated are still finished within ``grace_s``.
            weight_version: The version current when the round starts, recorded for attempts that
                generate nothing; an answer records the version that generated it.
        """
        config = self.config
        index = self._next_round if round_index is None else round_index
        self._next_round = index + 1
        batch_id = new_round_id(index)
        skills = assign_round(
            config.setting, index, envs_per_round=config.envs_per_round, skills_per_round=config.skills_per_round
        )
        state = RoundState.empty()
        gate = asyncio.Semaphore(config.concurrency)

        async def slot_task(slot: int, skill: Skill) -> None:
            first = 0
            while first < config.max_attempts_per_env:
                wave = range(first, min(first + config.attempts_at_once, config.max_attempts_per_env))
                generating = [
                    asyncio.ensure_future(self._generate(gate, index, batch_id, slot, attempt, skill, weight_version))
                    for attempt in wave
                ]
                taken = 0
                try:
                    for record in generating:
                        generated = await record
                        taken += 1
                        if await self._finish_in_turn(generated, state):
                            return
                finally:
                    await _discard(generating[taken:], state, batch_id)
                first = wave.stop

        return await run_slots(
            batch_id,
            index,
            [slot_task(slot, skill) for slot, skill in enumerate(skills)],
            state,
            deadline_s=config.batch_timeout_s,
            stop=stop,
            grace_s=config.grace_s,
        )

    async def _generate(
        self,
        gate: asyncio.Semaphore,
        round_index: int,
        batch_id: str,
        slot: int,
        attempt: int,
        skill: Skill,
        weight_version: int,
    ) -> AttemptRecord:
        """One attempt's prompt and generation (under ``gate``): its record, with the output, or with the
        generation's ``error`` (the record is ``GENERATION_FAILED`` until the pipeline finishes it)."""
        async with gate:
            return await self._prompt_and_generate(round_index, batch_id, slot, attempt, skill, weight_version)

    async def _prompt_and_generate(
        self, round_index: int, batch_id: str, slot: int, attempt: int, skill: Skill, weight_version: int
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
            budget=config.budget,
        )
        fitted = fit_prompt(
            parts,
            self._llm.apply_chat_template,
            max_prompt_tokens=config.max_prompt_tokens,
            doc_min_words=config.doc_min_words,
        )
        sampling = config.sampling
        if self._seeds is not None:
            sampling = replace(sampling, seed=self._seeds(round_index, slot, attempt, "design", 0))
        record = AttemptRecord(
            sample_id=uuid.uuid4().hex,
            batch_id=batch_id,
            slot=slot,
            attempt=attempt,
            setting=config.setting,
            skill=skill.name,
            outcome=AttemptOutcome.GENERATION_FAILED,
            weight_version=weight_version,
            prompt_ids=tuple(fitted.prompt_ids),
            prompt_messages=tuple(fitted.messages),
            source=dict(document.metadata),
            round_index=round_index,
            spec_id=config.spec_id,
            trainable=config.trainable,
            constrained=sampling.regex is not None,
        )
        try:
            generation = await self._llm.generate(list(fitted.prompt_ids), sampling)
        except asyncio.CancelledError:
            raise
        except Exception as error:
            log.warning("designer generation failed (round %s slot %d): %s", batch_id, slot, error)
            return replace(record, error=f"{type(error).__name__}: {error}")
        return replace(
            record,
            output_ids=tuple(generation.output_ids),
            logprobs=tuple(generation.logprobs),
            weight_version=int(generation.weight_version),
            finish_reason=generation.finish_reason,
            text=generation.text,
        )

    async def _finish_in_turn(self, record: AttemptRecord, state: RoundState) -> bool:
        """Finish a generated attempt (its turn in the slot has come); whether it filled the slot."""
        if record.error:  # the generation failed
            state.records.append(self._pipeline.give_up(record))
            return False
        # From here on the answer is the slot's: finish it even if the round's end cancels the slot.
        finished = await state.finish(self._pipeline.finish(record))
        state.records.append(finished)
        return finished.outcome is AttemptOutcome.VALID

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


async def _discard(generating: Sequence[asyncio.Future[AttemptRecord]], state: RoundState, batch_id: str) -> None:
    """Cancel a slot's attempts still generating; count and log those already generated, which are
    never finished (an earlier attempt filled the slot, or the round ended): no sample, no record."""
    for task in generating:
        task.cancel()
    await asyncio.gather(*generating, return_exceptions=True)
    for task in generating:
        if task.cancelled() or task.exception() is not None:
            continue
        record = task.result()
        if record.error:  # its generation failed: nothing was generated
            continue
        state.discarded += 1
        log.info(
            "designer round %s slot %d: attempt %d generated %d tokens and is discarded unfinished "
            "(the slot was filled by an earlier attempt, or the round ended)",
            batch_id,
            record.slot,
            record.attempt,
            len(record.output_ids),
        )
