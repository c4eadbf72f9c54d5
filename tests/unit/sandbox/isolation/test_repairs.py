"""The service's own repairs: what a session's jail loads, decided from the caller's code alone."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from services.sandbox.isolation import repairs as repairs_module
from services.sandbox.isolation.repairs import Repairs, digest
from spade.envs.examples import EXAMPLES
from spade.envs.repair import repair_code

NEEDS = 'class FixEnv:\n    def reset(self, seed=None):\n        return f"Reply \\\\boxed{done}", {}\n'


async def test_code_that_needs_no_repair_is_sent_as_it_is_and_not_remembered() -> None:
    repairs = Repairs()
    code = EXAMPLES["code_breaker"].code
    prepared = await repairs.prepare(code)
    assert (prepared.code, prepared.repaired) == (code, False) and len(repairs) == 0


async def test_code_that_needs_a_repair_is_repaired_here_and_remembered_both_ways() -> None:
    repairs = Repairs()
    fixed = repair_code(NEEDS)[0]
    assert fixed != NEEDS
    prepared = await repairs.prepare(NEEDS)
    assert (prepared.code, prepared.repaired) == (fixed, True)
    assert repairs.known(NEEDS) == repairs.known(fixed) == fixed
    assert (await repairs.prepare(fixed)).code == fixed  # the repaired code maps to itself


async def test_large_code_is_repaired_off_the_event_loop_with_the_same_result(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(repairs_module, "INLINE_BYTES", 10)
    threads: list[str] = []

    async def to_thread(fn: Callable[..., Any], *args: Any) -> Any:
        threads.append(fn.__name__)
        return fn(*args)

    monkeypatch.setattr(repairs_module.asyncio, "to_thread", to_thread)
    assert await Repairs().repaired(NEEDS) == repair_code(NEEDS)[0]
    assert threads == ["repair_code"]


def test_the_cache_is_bounded_least_recently_used_first_out() -> None:
    repairs = Repairs(size=4)
    for i in range(3):
        repairs.remember(f"code {i}", f"fixed {i}")
    assert len(repairs) == 4 and repairs.known("code 0") is None and repairs.known("fixed 2") == "fixed 2"
    assert digest("x") == digest("x") != digest("y")
