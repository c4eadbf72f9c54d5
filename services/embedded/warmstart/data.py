"""The warm start's material: validated (real designer prompt -> family answer) pairs.

Each prompt is built by the designer's own code (``services/designer/core/prompts.py``) exactly as
``Designer._attempt`` builds one: a corpus document cut to ``doc_max_words``, the example env of the
rotation, memory examples, the skill and the agent's budget, fitted to the prompt budget with the
policy's chat template. The answer is ``designer_answer(code, hint)`` of a training family whose skill is the
prompt's (every game skill has one; a skill without a family takes a family's own skill instead, so
the prompt never asks for another skill than the answer shows). Difficulty and variant are drawn per
pair. Every answer's code is validated in the real sandbox first; only a valid one becomes a
:class:`Pair` (its constructor refuses anything else), the rest are counted by failing check.

The answer's tokens are what the policy itself would emit: the answer text tokenised on its own,
then the end-of-turn token (EOS) that stops generation, so ``prompt_ids + answer_ids`` is exactly the
sequence a designer sample of that answer would hold.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from services.designer.core.ports import MemoryExample, MemoryExamples
from services.designer.core.prompts import AgentBudget, ExampleEnv, PromptParts, fit_prompt, truncate_words
from services.designer.core.skills import Skill, skill_named, skills_for
from spade.envs.types import Setting
from spade.inference.answer_format import designer_answer

if TYPE_CHECKING:
    from services.designer.corpus.loader import Corpus, Document
    from spade.envs import ValidationReport
    from spade.envs.families import Family, FamilyEnv

Tokenize = Callable[[list[dict[str, str]]], list[int]]
"""Chat template + tokenizer of the policy (``ChatFormatter.apply``): messages to prompt ids."""
Validate = Callable[[str], Awaitable["ValidationReport"]]
"""Sandbox validation of one env's code (setting and limits bound)."""
Progress = Callable[[str, float, float], None]
"""``progress(phase, done, total)``."""

#: Variants drawn per pair (the families' secondary literals: class name, wording, ranges).
VARIANTS = 8
#: Redraws of (family, difficulty, variant) before a pair may repeat an earlier pair's program.
REDRAWS = 8
#: Why the memory examples of a warm-start prompt are shown (they are validated, never played).
MEMORY_REASON = "seed-pool env from a family generator: validated, not yet scored"


class InvalidPairError(ValueError):
    """A pair was built from an answer the sandbox did not accept (the data builder's guard)."""


@dataclass(frozen=True)
class PairConfig:
    """What shapes the prompts (the designer's values) and the draw of the answers.

    Attributes:
        setting: ``"game"`` or ``"tool"``.
        count: Pairs planned (before validation drops the invalid ones).
        seed: Seeds the draw of families, difficulties, variants and documents.
        max_prompt_tokens: The designer's prompt budget.
        max_answer_tokens: The designer's answer budget; longer answers are dropped.
        doc_max_words: Documents are cut to this many words (the designer's ``doc_max_words``).
        doc_min_words: The budget halves the document down to this.
        memory_examples: Earlier envs shown per prompt (seed-pool envs of another family).
        excerpt_chars: Memory excerpts are cut to this many characters (the designer's default).
        budget: The agent's budget the prompt states.
    """

    setting: str = Setting.GAME
    count: int = 32
    seed: int = 0
    max_prompt_tokens: int = 1024
    max_answer_tokens: int = 1024
    doc_max_words: int = 600
    doc_min_words: int = 100
    memory_examples: int = 1
    excerpt_chars: int = 1200
    budget: AgentBudget = field(default_factory=AgentBudget)


@dataclass(frozen=True)
class Planned:
    """One pair before validation: the prompt it will have and the env it will answer with."""

    index: int
    skill: Skill
    env: FamilyEnv
    document: Document | None
    example: ExampleEnv | None
    memory: MemoryExamples


@dataclass(frozen=True)
class Pair:
    """One validated training pair.

    Attributes:
        prompt_ids: The chat-templated prompt, as the designer sends it (ends with the assistant header).
        answer_ids: The answer's tokens followed by EOS: what the SFT loss covers, exactly.
        messages: The prompt's messages (system, user).
        answer: The answer text (``designer_answer(code, hint)``).
        env: The family env answered with.
        skill: The prompt's target skill (the family's).
        document: The corpus document's metadata (``line`` and the corpus' own keys), empty without one.
        report: The sandbox's validation report of the answer's code; always valid.
    """

    prompt_ids: tuple[int, ...]
    answer_ids: tuple[int, ...]
    messages: tuple[dict[str, str], ...]
    answer: str
    env: FamilyEnv
    skill: str
    document: dict[str, Any]
    report: ValidationReport

    def __post_init__(self) -> None:
        if not self.report.valid:
            failed = ", ".join(c.name for c in self.report.checks if not c.passed) or "unknown"
            raise InvalidPairError(
                f"{self.env.name} failed validation ({failed}): only sandbox-validated answers are trained on"
            )
        if not self.answer_ids or not self.prompt_ids:
            raise InvalidPairError(f"{self.env.name}: a pair needs prompt and answer tokens")

    @property
    def tokens(self) -> int:
        """Prompt plus answer tokens."""
        return len(self.prompt_ids) + len(self.answer_ids)


@dataclass
class PairSet:
    """The pairs built and what was dropped, with the reasons counted.

    Attributes:
        pairs: Valid pairs, in plan order.
        planned: Pairs planned.
        invalid: Dropped answers by failing check (``"<check>"``); the whole report is not kept.
        too_long: Answers over the answer budget (dropped before validation).
        programs: Distinct programs among the valid pairs.
        validated: Distinct programs sent to the sandbox.
        training_documents: Corpus lines the prompts used (never used by the evaluation).
    """

    pairs: list[Pair] = field(default_factory=list)
    planned: int = 0
    invalid: Counter[str] = field(default_factory=Counter)
    too_long: int = 0
    programs: int = 0
    validated: int = 0
    training_documents: list[int] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        """Counts for ``warmstart.json``."""
        prompt = [len(p.prompt_ids) for p in self.pairs]
        answer = [len(p.answer_ids) for p in self.pairs]
        return {
            "planned": self.planned,
            "valid": len(self.pairs),
            "invalid": dict(self.invalid),
            "too_long": self.too_long,
            "distinct_programs": self.programs,
            "validated_programs": self.validated,
            "families": dict(Counter(p.env.family for p in self.pairs)),
            "skills": dict(Counter(p.skill for p in self.pairs)),
            "prompt_tokens": _spread(prompt),
            "answer_tokens": _spread(answer),
        }


def _spread(values: Sequence[int]) -> dict[str, float]:
    if not values:
        return {}
    return {"min": min(values), "mean": round(sum(values) / len(values), 1), "max": max(values)}


def code_digest(code: str) -> str:
    """The memory's content hash of a program (same program however formatted, same digest)."""
    from services.memory.core.normalise import code_hash

    return code_hash(code)


def split_documents(corpus: Corpus, held_out: int, seed: int) -> tuple[list[Document], list[Document]]:
    """A seeded split of the corpus: (training documents, ``held_out`` evaluation documents), disjoint.

    >>> from services.designer.corpus.loader import parse_lines
    >>> train, held = split_documents(parse_lines([f'{{"text": "d{i}"}}' for i in range(10)]), 3, 0)
    >>> len(train), len(held), {d.text for d in train} & {d.text for d in held}
    (7, 3, set())
    """
    if held_out >= len(corpus.documents):
        raise ValueError(
            f"the corpus has {len(corpus.documents)} documents: it cannot keep {held_out} out of training; "
            "lower held_out_documents or use a larger corpus"
        )
    order = list(range(len(corpus.documents)))
    random.Random(f"warmstart-documents/{seed}").shuffle(order)
    held = [corpus.documents[i] for i in order[:held_out]]
    train = [corpus.documents[i] for i in order[held_out:]]
    return train, held


def family_for(skill: Skill, families: Sequence[Family], rng: random.Random) -> tuple[Family, Skill]:
    """A family whose skill is ``skill``, and the skill the prompt then asks for.

    Without such a family any family is drawn and the prompt asks for that family's own skill, so
    the prompt stays truthful about what the answer exercises.
    """
    fitting = [f for f in families if f.skill.lower() == skill.name.lower()]
    if fitting:
        return rng.choice(fitting), skill
    family = rng.choice(list(families))
    return family, skill_named(family.setting, family.skill)


def memory_for(family: str | None, pool: Sequence[FamilyEnv], count: int, rng: random.Random) -> MemoryExamples:
    """Up to ``count`` memory positives drawn from ``pool``, none of family ``family`` (the answer's)."""
    others = [e for e in pool if e.family != family]
    if count == 0 or not others:
        return MemoryExamples()
    picks = rng.sample(others, min(count, len(others)))
    return MemoryExamples(
        positives=tuple(MemoryExample(code=e.code, reason=MEMORY_REASON, skill=e.skill) for e in picks)
    )


def plan_pairs(
    config: PairConfig,
    *,
    families: Sequence[Family],
    documents: Sequence[Document],
    examples: Sequence[ExampleEnv] = (),
    memory_pool: Sequence[FamilyEnv] = (),
) -> list[Planned]:
    """Draw ``config.count`` pairs: skills in the designer's rotation, a family of each skill, a
    difficulty in [0, 1] and a variant, a training document, the example of the rotation.

    A draw that repeats an earlier pair's program is redrawn (up to ``REDRAWS`` times), so the pairs
    teach many programs rather than one many times.

    Raises:
        ValueError: No family, or a family of another setting.
    """
    if not families:
        raise ValueError(f"no {config.setting} family to answer with: the warm start needs training families")
    wrong = [f.name for f in families if f.setting != config.setting]
    if wrong:
        raise ValueError(f"families {wrong} are not {config.setting} families")
    rng = random.Random(f"warmstart-pairs/{config.seed}")
    skills = skills_for(config.setting)
    docs = list(documents)
    rng.shuffle(docs)
    seen: set[str] = set()
    planned: list[Planned] = []
    for index in range(config.count):
        wanted = skills[index % len(skills)]
        for _ in range(REDRAWS):
            family, skill = family_for(wanted, families, rng)
            env = family.generate(round(rng.random(), 2), rng.randrange(VARIANTS))
            if code_digest(env.code) not in seen:
                break
        seen.add(code_digest(env.code))
        planned.append(
            Planned(
                index=index,
                skill=skill,
                env=env,
                document=docs[index % len(docs)] if docs else None,
                example=examples[index % len(examples)] if examples else None,
                memory=memory_for(env.family, memory_pool, config.memory_examples, rng),
            )
        )
    return planned


def prompt_parts(config: PairConfig, planned: Planned) -> PromptParts:
    """The designer's prompt parts for ``planned`` (as ``Designer._attempt`` builds them)."""
    return designer_parts(
        config, skill=planned.skill, document=planned.document, example=planned.example, memory=planned.memory
    )


def designer_parts(
    config: PairConfig,
    *,
    skill: Skill,
    document: Document | None,
    example: ExampleEnv | None,
    memory: MemoryExamples,
) -> PromptParts:
    """Prompt parts as ``Designer._attempt`` builds them: the document cut to ``doc_max_words``."""
    return PromptParts(
        setting=config.setting,
        skill=skill,
        document=truncate_words(document.text if document is not None else "", config.doc_max_words),
        example=example,
        memory=memory,
        excerpt_chars=config.excerpt_chars,
        budget=config.budget,
    )


def answer_ids(answer: str, tokenizer: Any) -> list[int]:
    """The policy's tokens of ``answer`` followed by its EOS (the end-of-turn token that stops generation).

    Raises:
        ValueError: The tokenizer has no EOS token.
    """
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token_id: the answer's end cannot be trained")
    return [*tokenizer.encode(answer, add_special_tokens=False), int(eos)]


async def build_pairs(
    config: PairConfig,
    *,
    tokenize: Tokenize,
    tokenizer: Any,
    validate: Validate,
    families: Sequence[Family],
    documents: Sequence[Document],
    examples: Sequence[ExampleEnv] = (),
    memory_pool: Sequence[FamilyEnv] = (),
    concurrency: int = 2,
    progress: Progress | None = None,
) -> PairSet:
    """Plan, render, validate and keep the valid pairs.

    Args:
        config: Prompt budgets and the draw.
        tokenize: The policy's chat template (messages -> prompt ids).
        tokenizer: The policy's tokenizer (answer tokens, EOS).
        validate: Sandbox validation of a program (``SandboxPool.validate`` with the setting and the
            agent's turn budget bound).
        families: The families answers come from (the training families; never held-out ones).
        documents: Training documents (held-out ones excluded by the caller).
        examples: The example envs of the designer's prompt rotation.
        memory_pool: Envs memory examples are drawn from.
        concurrency: Validations in flight at once.
        progress: Called as programs are validated (phase ``"pairs"``).

    Returns:
        The valid pairs, with every dropped answer counted by reason.
    """
    held = [f.name for f in families if f.held_out]
    if held:
        raise ValueError(f"held-out families {held} must never be trained on")
    planned = plan_pairs(config, families=families, documents=documents, examples=examples, memory_pool=memory_pool)
    result = PairSet(planned=len(planned))
    rendered: list[tuple[Planned, list[int], list[dict[str, str]], list[int]]] = []
    for item in planned:
        ids = answer_ids(designer_answer(item.env.code, item.env.hint), tokenizer)
        if len(ids) > config.max_answer_tokens:
            result.too_long += 1
            continue
        fitted = fit_prompt(
            prompt_parts(config, item),
            tokenize,
            max_prompt_tokens=config.max_prompt_tokens,
            doc_min_words=config.doc_min_words,
        )
        rendered.append((item, fitted.prompt_ids, fitted.messages, ids))
    reports = await validate_programs([item.env.code for item, *_ in rendered], validate, concurrency, progress)
    result.validated = len(reports)
    programs: set[str] = set()
    for item, prompt, messages, ids in rendered:
        report = reports[code_digest(item.env.code)]
        if not report.valid:
            result.invalid[next((c.name for c in report.checks if not c.passed), "unknown")] += 1
            continue
        programs.add(code_digest(item.env.code))
        document = dict(item.document.metadata) if item.document is not None else {}
        if "line" in document:
            result.training_documents.append(int(document["line"]))  # type: ignore[call-overload]
        result.pairs.append(
            Pair(
                prompt_ids=tuple(prompt),
                answer_ids=tuple(ids),
                messages=tuple(messages),
                answer=designer_answer(item.env.code, item.env.hint),
                env=item.env,
                skill=item.skill.name,
                document=document,
                report=report,
            )
        )
    result.programs = len(programs)
    return result


async def validate_programs(
    codes: Sequence[str], validate: Validate, concurrency: int = 2, progress: Progress | None = None
) -> dict[str, ValidationReport]:
    """Validate each distinct program once; reports by content digest."""
    unique = {code_digest(code): code for code in codes}
    gate = asyncio.Semaphore(max(1, concurrency))
    reports: dict[str, ValidationReport] = {}
    done = 0
    if progress is not None:
        progress("pairs", 0, len(unique))

    async def one(digest: str, code: str) -> None:
        nonlocal done
        async with gate:
            reports[digest] = await validate(code)
        done += 1
        if progress is not None:
            progress("pairs", done, len(unique))

    await asyncio.gather(*(one(d, c) for d, c in unique.items()))
    return reports
