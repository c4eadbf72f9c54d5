"""Every warm-start pair's answer passed the real sandbox before it is trained on: the builder sends
each program to a jail (within the agent's turn budget) and refuses the ones it rejects, naming the
failing check."""

from __future__ import annotations

from dataclasses import replace

import pytest

from services.designer.adapters import checks_within
from services.designer.core.prompts import AgentBudget
from services.embedded.warmstart.data import PairConfig, build_pairs, code_digest
from services.sandbox.isolation import SandboxPool
from spade.envs import CheckConfig, ValidationReport
from spade.envs.families import FAMILIES, Family
from tests.unit.embedded.warmstart_helpers import WordTokenizer, chat, documents

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]


def memorisable(family: Family) -> Family:
    """``family`` with every seed giving the same instance (the defect ``seed_variety`` rejects)."""

    def builder(difficulty: float, variant: int) -> tuple[dict[str, int | float | str], str, str]:
        params, code, hint = family.builder(difficulty, variant)
        broken = code.replace("random.Random(seed)", "random.Random(7)")
        assert broken != code
        return params, broken, hint

    return replace(family, name=f"{family.name}-memorisable", builder=builder)


async def test_only_answers_the_sandbox_accepted_become_pairs(sandbox_pool: SandboxPool) -> None:
    checks = checks_within(CheckConfig(), 3)
    seen: dict[str, ValidationReport] = {}

    async def validate(code: str) -> ValidationReport:
        report = await sandbox_pool.validate(code, "game", checks)
        seen[code_digest(code)] = report
        return report

    # The only Logical Deduction family is the broken one, so the rotation's Logical Deduction slot
    # always draws it; the other skills' slots draw a family of their own or, without one, any family.
    broken = memorisable(FAMILIES["hidden_number"])
    families = [FAMILIES["add"], FAMILIES["echo"], broken]
    config = PairConfig(count=6, max_prompt_tokens=4000, budget=AgentBudget(3, 48), seed=1)
    built = await build_pairs(
        config, tokenize=chat, tokenizer=WordTokenizer(), validate=validate, families=families, documents=documents(20)
    )
    from_broken = built.planned - len(built.pairs)
    assert from_broken > 0, "the draw never picked the broken family: the test proved nothing"
    assert built.invalid == {"seed_variety": from_broken}
    assert built.pairs and all(p.env.family != broken.name for p in built.pairs)
    for pair in built.pairs:
        assert pair.report.valid
        assert pair.skill == pair.env.skill
        assert seen[code_digest(pair.env.code)] is pair.report  # the report is the sandbox's own verdict
    assert built.validated == len(seen)
