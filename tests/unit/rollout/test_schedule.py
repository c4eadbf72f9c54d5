"""The window schedule: slots keyed by the env's own window, due in order, late but never skipped."""

from __future__ import annotations

import doctest

import pytest

from services.rollout.core import schedule
from services.rollout.core.schedule import ActiveEnv, EnvStatus, current_version, due_slot, is_late


def _env(design: int = 5, window: int = 3) -> ActiveEnv:
    return ActiveEnv("e", "game", "Optimization", "d1", window=window, design_version=design)


def test_the_doctests_hold() -> None:
    assert doctest.testmod(schedule).failed == 0


def test_the_first_plays_are_due_whatever_the_latest_version() -> None:
    env = _env()
    for latest in (None, 0, 5, 6, 900):
        assert due_slot(env, latest) == 0
    assert not env.closed  # regret is always measured, however late the env is played first


def test_the_window_starts_at_the_version_current_at_the_first_play_not_the_design_version() -> None:
    # Version drift: designed at 5, the learner published 6 and 7 before the rollout got to it.
    start = current_version(design_version=5, latest=7)
    env = _env().fixed(start, 3)
    assert (env.slot_version(0), env.slot_version(2)) == (7, 9)
    assert current_version(design_version=5, latest=None) == 5
    assert current_version(design_version=5, latest=3) == 5  # never before the env existed


def test_each_slot_is_due_once_its_version_is_published() -> None:
    env = _env().fixed(5, 3).done(0)
    assert due_slot(env, 5) is None
    assert due_slot(env, 6) == 1 and not is_late(env, 1, 6)
    env = env.done(1)
    assert due_slot(env, 6) is None and due_slot(env, 7) == 2
    env = env.done(2)
    assert env.closed and due_slot(env, 99) is None


def test_a_slot_whose_version_passed_is_played_late_under_its_own_index_never_skipped() -> None:
    env = _env().fixed(5, 4).done(0)
    # Versions 6..9 were all published while the rollout was busy: slots 1, 2, 3 come in order.
    for slot in (1, 2, 3):
        assert due_slot(env, 9) == slot
        assert is_late(env, slot, 9) is (slot < 4)
        env = env.done(slot)
    assert env.closed


def test_slots_complete_in_order_and_completing_twice_changes_nothing() -> None:
    env = _env().fixed(0, 2).done(0).done(0)
    assert env.slots_done == 1
    assert env.done(1).done(0).slots_done == 2


def test_a_window_of_one_closes_after_the_first_plays() -> None:
    env = _env(window=1).fixed(5, 1)
    assert due_slot(env, None) == 0
    assert env.done(0).closed


def test_closed_or_retired_envs_are_never_due() -> None:
    env = ActiveEnv("e", "game", "s", "d", 4, window_start=1, slots_done=1, status=EnvStatus.CLOSED)
    assert due_slot(env, 3) is None


def test_slot_versions_need_a_fixed_window_and_a_slot_inside_it() -> None:
    with pytest.raises(ValueError, match="not fixed yet"):
        _env().slot_version(0)
    with pytest.raises(ValueError, match="outside"):
        _env().fixed(1, 3).slot_version(3)
    with pytest.raises(ValueError, match="at least one slot"):
        ActiveEnv("e", "game", "s", "d", window=0)
