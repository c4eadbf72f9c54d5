"""The pace of audit turns: drawn from the real turns' recorded gaps (``spade/agent/pace.py``)."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from spade.agent.pace import TurnPace


def test_draws_come_from_the_recorded_gaps_and_follow_the_recent_ones() -> None:
    pace = TurnPace(keep=3, first_gap_wait_s=0.0)
    for gap in (9.0, 1.0, 2.0, 3.0):  # 9.0 is forgotten: only the last three are kept
        pace.record(gap)
    rng = random.Random(7)
    draws = {asyncio.run(pace.gap(rng)) for _ in range(60)}
    assert draws == {1.0, 2.0, 3.0}


def test_a_draw_before_any_real_turn_waits_for_the_first_and_takes_its_time() -> None:
    async def main() -> tuple[float, float]:
        pace = TurnPace(first_gap_wait_s=30.0)
        loop = asyncio.get_running_loop()
        loop.call_later(0.3, pace.record, 0.3)  # a real turn beside the audit records its gap
        started = time.monotonic()
        gap = await pace.gap(random.Random(0))
        return gap, time.monotonic() - started

    gap, waited = asyncio.run(main())
    assert 0.25 <= gap <= waited and gap < 30.0  # it took the real turn's time, and returned before its bound


def test_without_real_turns_the_first_draw_waits_only_its_bound() -> None:
    gap = asyncio.run(TurnPace(first_gap_wait_s=0.2).gap(random.Random(0)))
    assert gap >= 0.2  # the whole bound, then the time it waited


def test_wait_sleeps_the_drawn_gap() -> None:
    pace = TurnPace()
    pace.record(0.3)
    started = time.monotonic()
    assert asyncio.run(pace.wait(random.Random(0))) == 0.3
    assert time.monotonic() - started >= 0.3


@pytest.mark.parametrize("gap", [-1.0, float("nan"), float("inf")])
def test_a_gap_must_be_a_duration(gap: float) -> None:
    with pytest.raises(ValueError, match="duration in seconds"):
        TurnPace().record(gap)
