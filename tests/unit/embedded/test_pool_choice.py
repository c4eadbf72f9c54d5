"""The pool envs a step plays: expected signal first, never-played next, least recently played first."""

from __future__ import annotations

import pytest

from services.embedded.pool_choice import PoolChoice


def test_learnable_envs_come_first_then_unplayed_then_the_rest_nearest_half() -> None:
    choice = PoolChoice(["easy", "hard", "mid", "fresh", "near"], per_step=5, retire_after=3)
    choice.observe(1, {"easy": [0.9, 1.0], "hard": [0.0, 0.1], "mid": [0.4, 0.6], "near": [0.8, 1.0]})
    assert choice.choose() == ["mid", "fresh", "near", "easy", "hard"]


def test_a_step_after_one_that_trained_nothing_plays_something_new() -> None:
    choice = PoolChoice([f"e{i}" for i in range(6)], per_step=2, retire_after=5)
    first = choice.choose()
    choice.observe(1, {env: [0.0, 0.0] for env in first})  # every group without variance
    second = choice.choose()
    assert set(second).isdisjoint(first)
    choice.observe(2, {env: [0.0, 0.0] for env in second})
    assert set(choice.choose()).isdisjoint({*first, *second})


def test_only_envs_with_a_slot_due_are_chosen_in_their_order() -> None:
    choice = PoolChoice(["easy", "hard", "mid", "fresh", "near"], per_step=2, retire_after=3)
    choice.observe(1, {"easy": [0.9, 1.0], "hard": [0.0, 0.1], "mid": [0.4, 0.6], "near": [0.8, 1.0]})
    assert choice.choose() == ["mid", "fresh"]
    # "mid" waits for its next weight version (overlapped learner): the next best in order instead.
    assert choice.choose(due={"easy", "hard", "fresh", "near"}) == ["fresh", "near"]
    assert choice.choose(due=set()) == []


def test_envs_without_signal_for_several_slots_are_retired_and_never_chosen() -> None:
    choice = PoolChoice(["dead", "alive"], per_step=2, retire_after=2)
    for step in (1, 2):
        choice.observe(step, {"dead": [0.0, 0.0], "alive": [0.2, 0.7]})
    assert choice.retired == {"dead"} and choice.choose() == ["alive"]
    assert choice.skipped(["alive"]) == {"dead"}


def test_variance_resets_the_barren_count() -> None:
    choice = PoolChoice(["e"], per_step=1, retire_after=2)
    choice.observe(1, {"e": [0.0, 0.0]})
    choice.observe(2, {"e": [0.0, 0.5]})
    choice.observe(3, {"e": [0.0, 0.0]})
    assert choice.retired == set() and choice.choose() == ["e"]


def test_bad_budgets_are_refused() -> None:
    with pytest.raises(ValueError, match="per_step"):
        PoolChoice(["e"], per_step=0, retire_after=1)
