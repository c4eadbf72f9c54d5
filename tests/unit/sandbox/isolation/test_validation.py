"""Validation through sessions: the checker's thread, the pool's loop, and what a stop or a broken
sandbox makes of the verdict (fake sessions here; the real ones in ``tests/security``)."""

from __future__ import annotations

import asyncio

import pytest

from services.sandbox.isolation.outcomes import SandboxFault
from services.sandbox.isolation.session import SandboxSession, ended_outcome
from services.sandbox.isolation.validation import validate_in_sessions
from spade.envs import CHECK_NAMES, CheckConfig, Outcome
from spade.envs.examples import EXAMPLES

CODE = EXAMPLES["number_hunt"].code


async def test_a_sandbox_fault_gives_no_verdict() -> None:
    """A session the sandbox could not start is the sandbox's failure, never the env's defect."""
    opened: list[int] = []

    async def broken(code: str, setting: str, seed: int, config: CheckConfig) -> SandboxSession:
        opened.append(seed)
        return SandboxSession.failed(ended_outcome(Outcome.SANDBOX_FAULT, "no zygote is running", None))

    with pytest.raises(SandboxFault, match="no zygote is running"):
        await validate_in_sessions(broken, CODE, "game", CheckConfig(), 30.0)
    assert len(opened) == 1  # the validation stopped at the first fault


async def test_a_validation_past_its_wall_clock_names_the_check_it_stopped_in() -> None:
    started = asyncio.Event()

    async def hanging(code: str, setting: str, seed: int, config: CheckConfig) -> SandboxSession:
        started.set()
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    report = await validate_in_sessions(hanging, CODE, "game", CheckConfig(), 0.5)
    assert started.is_set() and not report.valid
    assert [c.name for c in report.checks] == list(CHECK_NAMES)
    structure = report.check("structure")
    assert structure.detail.startswith("stopped while running: the validation ran past its wall-clock limit of 0.5 s")
    assert report.check("smoke").detail.startswith("not run")
