"""Every environment family validates through the real sandbox, as the seed pool and the designer's
warm start will submit it: every episode a validation plays is a session of its own."""

from __future__ import annotations

import asyncio

import pytest

from services.sandbox.isolation import SandboxPool
from spade.envs import CHECK_NAMES, CheckConfig, ValidationReport
from spade.envs.families import FAMILIES, FamilyEnv, seed_pool_envs

pytestmark = pytest.mark.sandbox

CHECKS = CheckConfig(random_policy_episodes=60)
"""Validation's seeds are secret, so a random policy's win count is a sample: the families' true rates
(at most ~7%) are held to the 15% limit over 60 episodes, where a false alarm is rare, not over 20."""
AT_ONCE = 4
"""Validations in flight at once: each plays ~90 sessions, and all of them at once on a small, shared
machine would run past their wall clock."""


async def invalid(pool: SandboxPool, envs: list[FamilyEnv], checks: CheckConfig) -> dict[str, str]:
    """The envs the sandbox rejects, with why (validated ``AT_ONCE`` at a time)."""
    slots = asyncio.Semaphore(AT_ONCE)

    async def validate(env: FamilyEnv) -> ValidationReport:
        async with slots:
            return await pool.validate(env.code, env.setting, checks)

    reports = await asyncio.gather(*(validate(e) for e in envs))
    for report, env in zip(reports, envs, strict=True):
        assert [c.name for c in report.checks] == list(CHECK_NAMES)
        assert report.repaired_code == env.code or not report.valid
    return {env.name: report.summary() for report, env in zip(reports, envs, strict=True) if not report.valid}


async def test_every_family_validates_in_the_sandbox_across_its_difficulty_range(sandbox_pool: SandboxPool) -> None:
    # A few envs per family: both ends of the knob, with different secondary literals.
    envs = [family.generate(d, v) for family in FAMILIES.values() for d, v in ((0.0, 1), (1.0, 2))]
    assert await invalid(sandbox_pool, envs, CHECKS) == {}


async def test_the_seed_pool_validates_at_the_agents_turn_budget(sandbox_pool: SandboxPool) -> None:
    envs = seed_pool_envs("game", per_family=1)
    assert await invalid(sandbox_pool, envs, CHECKS.with_turn_budget(3)) == {}
