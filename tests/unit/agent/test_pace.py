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


def test_an_env_s_audit_draws_from_that_env_s_real_gaps_only() -> None:
    # Another env's long turns (a busier moment) must not slow this env's audit: the env can compare
    # its audit's calls with its own real plays' only.
    pace = TurnPace(first_gap_wait_s=0.0)
    for gap in (9.0, 10.0):
        pace.record(gap, "busy-env")
    for gap in (1.0, 2.0):
        pace.record(gap, "this-env")
    rng = random.Random(3)
    assert {asyncio.run(pace.gap(rng, "this-env")) for _ in range(40)} == {1.0, 2.0}
    assert {asyncio.run(pace.gap(rng)) for _ in range(80)} == {1.0, 2.0, 9.0, 10.0}  # the worker's: every env's
    assert len(pace) == 4


def test_an_audit_before_its_env_s_first_real_gap_waits_for_it_not_for_another_env_s() -> None:
    async def main() -> tuple[float, float]:
        pace = TurnPace(first_gap_wait_s=3600.0)
        pace.record(1000.0, "other-env")  # recorded earlier: not this env's pace
        loop = asyncio.get_running_loop()
        loop.call_later(0.3, pace.record, 0.3, "this-env")  # this env's first real turn, beside its audit
        started = time.monotonic()
        gap = await pace.gap(random.Random(0), "this-env")
        return gap, time.monotonic() - started

    gap, waited = asyncio.run(main())
    assert 0.25 <= gap <= waited and gap < 1000.0  # its own real turn's time, not the other env's gap


def test_an_audit_whose_env_plays_no_real_turn_falls_back_to_every_env_s_gaps_after_one_wait() -> None:
    async def main() -> list[float]:
        pace = TurnPace(first_gap_wait_s=0.0)
        pace.record(5.0, "other-env")
        first = await pace.gap(random.Random(0), "resumed-env")  # waits its bound once ...
        pace.first_gap_wait_s = 3600.0  # ... so a later draw that waited again would never return here
        later = [await asyncio.wait_for(pace.gap(random.Random(i), "resumed-env"), timeout=60) for i in range(3)]
        return [first, *later]

    assert asyncio.run(main()) == [5.0, 5.0, 5.0, 5.0]


def test_only_the_most_recent_envs_gaps_are_kept() -> None:
    pace = TurnPace(first_gap_wait_s=0.0, envs=2)
    pace.record(1.0, "a")
    pace.record(2.0, "b")
    pace.record(3.0, "c")  # "a" is forgotten: its audit would draw from every env's gaps
    rng = random.Random(0)
    assert {asyncio.run(pace.gap(rng, "c")) for _ in range(10)} == {3.0}
    assert {asyncio.run(pace.gap(rng, "a")) for _ in range(40)} == {1.0, 2.0, 3.0}
