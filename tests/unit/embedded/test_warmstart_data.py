"""The warm start's pairs: real designer prompts, family answers that parse back exactly, truthful
skills, and no pair without a valid validation report (the sandbox itself runs in
``tests/integration/warmstart/``)."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from services.designer.core.parsing import ParsedOutput, parse_output
from services.designer.core.prompts import AgentBudget
from services.designer.core.skills import skills_for
from services.designer.corpus.loader import parse_lines
from services.embedded.warmstart.data import (
    InvalidPairError,
    Pair,
    PairConfig,
    answer_ids,
    build_pairs,
    plan_pairs,
    split_documents,
)
from spade.envs import ValidationReport
from spade.envs.families import FAMILIES, FamilyEnv, held_out_families, seed_pool_envs, training_families
from spade.inference.answer_format import DESIGNER_ANSWER_REGEX, designer_answer
from tests.unit.embedded.warmstart_helpers import EOS, WordTokenizer, chat, documents, report

CONFIG = PairConfig(count=18, max_prompt_tokens=2000, budget=AgentBudget(3, 48))


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_family_answer_parses_back_to_exactly_its_code_and_hint(name: str) -> None:
    for difficulty in (0.0, 0.37, 1.0):
        for variant in range(4):
            env = FAMILIES[name].generate(difficulty, variant)
            parsed = parse_output(designer_answer(env.code, env.hint))
            assert parsed == ParsedOutput(code=env.code, hint=env.hint), env.name
            # The embedded run constrains small models to the answer format: a target outside it
            # could never be generated there.
            assert re.fullmatch(DESIGNER_ANSWER_REGEX, designer_answer(env.code, env.hint)), env.name


async def test_every_pair_answers_with_a_training_family_of_its_prompt_skill_and_parses_back() -> None:
    validated: list[str] = []

    async def validate(code: str) -> ValidationReport:
        validated.append(code)
        return report(True, code)

    built = await build_pairs(
        CONFIG,
        tokenize=chat,
        tokenizer=WordTokenizer(),
        validate=validate,
        families=training_families(),
        documents=documents(40),
        memory_pool=seed_pool_envs(),
    )
    assert len(built.pairs) == CONFIG.count and built.planned == CONFIG.count
    held = {f.name for f in held_out_families()}
    for pair in built.pairs:
        assert parse_output(pair.answer) == ParsedOutput(code=pair.env.code, hint=pair.env.hint)
        assert pair.env.family not in held
        assert pair.skill == pair.env.skill  # the prompt asks for what the answer exercises
        assert f"Target skill: {pair.skill}" in pair.messages[-1]["content"]
        assert pair.answer_ids == (*WordTokenizer().encode(pair.answer), EOS)
        assert pair.prompt_ids == tuple(chat(list(pair.messages)))
        assert pair.env.code in validated
    # The designer's rotation: every skill of the setting is asked for, three times in 18 pairs.
    assert Counter(p.skill for p in built.pairs) == {s.name: 3 for s in skills_for("game")}
    # Many programs, not one many times; every one validated once.
    assert built.programs == len({p.env.code for p in built.pairs}) >= 15
    assert len(validated) == len(set(validated)) == built.validated


async def test_invalid_and_overlong_answers_are_dropped_and_counted() -> None:
    families = training_families()
    refused = families[0].name

    async def validate(code: str) -> ValidationReport:
        refused_code = any(code == e.code for e in plan_envs(refused))
        return report(not refused_code, code, failed="solution_replay")

    def plan_envs(family: str) -> list[FamilyEnv]:
        return [p.env for p in plan_pairs(CONFIG, families=families, documents=documents(40)) if p.env.family == family]

    built = await build_pairs(
        CONFIG, tokenize=chat, tokenizer=WordTokenizer(), validate=validate, families=families, documents=documents(40)
    )
    dropped = len(plan_envs(refused))
    assert dropped > 0
    assert built.invalid == Counter({"solution_replay": dropped})
    assert len(built.pairs) == CONFIG.count - dropped
    assert all(p.env.family != refused for p in built.pairs)

    short = PairConfig(count=6, max_answer_tokens=20)
    none = await build_pairs(
        short, tokenize=chat, tokenizer=WordTokenizer(), validate=validate, families=families, documents=documents(8)
    )
    assert none.too_long == 6 and not none.pairs


def test_a_pair_refuses_an_answer_that_failed_validation() -> None:
    env = training_families()[0].generate(0.5)
    ids = tuple(answer_ids(designer_answer(env.code, env.hint), WordTokenizer()))

    def pair(valid: bool) -> Pair:
        return Pair(
            prompt_ids=(1, 2),
            answer_ids=ids,
            messages=(),
            answer=designer_answer(env.code, env.hint),
            env=env,
            skill=env.skill,
            document={},
            report=report(valid, env.code),
        )

    assert pair(True).tokens == 2 + len(ids)
    with pytest.raises(InvalidPairError, match="seed_variety"):
        pair(False)


async def test_held_out_families_are_never_trained_on() -> None:
    async def validate(code: str) -> ValidationReport:
        return report(True, code)

    with pytest.raises(ValueError, match="held-out"):
        await build_pairs(
            CONFIG,
            tokenize=chat,
            tokenizer=WordTokenizer(),
            validate=validate,
            families=[*training_families(), *held_out_families()],
            documents=documents(4),
        )


def test_the_prompt_fits_the_budget_and_memory_examples_come_from_other_families() -> None:
    planned = plan_pairs(CONFIG, families=training_families(), documents=documents(40), memory_pool=seed_pool_envs())
    for item in planned:
        assert item.memory.positives
        assert all(
            m.code not in {e.code for e in seed_pool_envs() if e.family == item.env.family}
            for m in item.memory.positives
        )
    assert plan_pairs(CONFIG, families=training_families(), documents=documents(40)) == plan_pairs(
        CONFIG, families=training_families(), documents=documents(40)
    )  # seeded


def test_held_out_documents_are_disjoint_from_training_documents() -> None:
    corpus = parse_lines([f'{{"text": "document {i}"}}' for i in range(50)])
    train, held = split_documents(corpus, 10, seed=3)
    assert len(held) == 10 and len(train) == 40
    assert not {d.text for d in train} & {d.text for d in held}
    assert split_documents(corpus, 10, seed=3) == (train, held)
    with pytest.raises(ValueError, match="held_out_documents"):
        split_documents(corpus, 50, seed=0)
