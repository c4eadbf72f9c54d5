"""The run spec: content-addressed, consistent, and naming each field a service contradicts."""

from __future__ import annotations

import doctest

import pytest
from pydantic import ValidationError

from spade import runspec
from spade.runspec import RewardConstants, RunSpec


def test_doctests() -> None:
    failures, tried = doctest.testmod(runspec)
    assert tried >= 3 and failures == 0


def test_spec_id_is_stable_and_follows_the_content() -> None:
    a, b = RunSpec(), RunSpec()
    assert a.spec_id == b.spec_id and len(a.spec_id) == 16
    assert RunSpec(group_size=8).spec_id != a.spec_id
    assert RunSpec.from_json(a.to_json()) == a and RunSpec.from_json(a.to_json()).spec_id == a.spec_id


def test_contradictions_name_each_field_and_ignore_unset_ones() -> None:
    spec = RunSpec(temperature=0.6, group_size=8)
    assert spec.contradictions({"temperature": 0.6, "group_size": None, "top_p": 1.0}) == []
    problems = spec.contradictions({"temperature": 0.0, "rewards.regret_scale": 0.2, "group_size": 8})
    assert len(problems) == 2
    assert problems[0].startswith("temperature: this service is configured with 0.0 but the run spec has 0.6")
    assert problems[1].startswith("rewards.regret_scale:")
    assert spec.contradictions({"rewards.plateau_band": [0.15, 0.4, 0.6, 0.85]}) == []


@pytest.mark.parametrize(
    "fields",
    [
        {"agent_max_tokens_per_turn": 4096, "agent_max_total_tokens": 4096},
        {"envs_per_round": 2, "skills_per_round": 3},
        {"rewards": RewardConstants(plateau_band=(0.5, 0.4, 0.6, 0.85))},
        {"temperature": 0.0},
        {"unknown_field": 1},
    ],
)
def test_inconsistent_specs_are_refused(fields: dict) -> None:
    with pytest.raises((ValidationError, ValueError)):
        RunSpec(**fields)


def test_window_per_setting() -> None:
    spec = RunSpec(window_versions_game=2, window_versions_tool=5)
    assert (spec.window_for("game"), spec.window_for("tool")) == (2, 5)
    with pytest.raises(ValueError, match="unknown setting"):
        spec.window_for("chess")
