"""Skill tables and their rotation over regeneration rounds (paper: 24 envs over 3 of 6 skills)."""

from __future__ import annotations

from collections import Counter

import pytest

from services.designer.core.skills import (
    GAME_SKILLS,
    TOOL_SKILLS,
    assign_round,
    round_skills,
    skill_named,
    skills_for,
)


def test_each_setting_has_the_six_skills_of_the_design() -> None:
    assert [s.name for s in GAME_SKILLS] == [
        "Mathematical Reasoning",
        "Logical Deduction",
        "Spatial Reasoning",
        "Pattern Recognition",
        "Optimization",
        "Causal Inference",
    ]
    assert [s.name for s in TOOL_SKILLS] == [
        "API Orchestration",
        "Data Retrieval",
        "State Modification",
        "Error Recovery",
        "Tool Selection",
        "Multi-Step Workflows",
    ]
    assert all(s.description for s in (*GAME_SKILLS, *TOOL_SKILLS))


@pytest.mark.parametrize("setting", ["game", "tool"])
@pytest.mark.parametrize(("envs", "skills"), [(24, 3), (2, 1), (6, 6), (7, 2), (5, 3), (12, 4), (7, 4)])
def test_over_many_rounds_each_round_has_its_skills_and_every_skill_recurs_balanced(
    setting: str, envs: int, skills: int
) -> None:
    rounds = 60
    total: Counter[str] = Counter()
    for r in range(rounds):
        slots = assign_round(setting, r, envs_per_round=envs, skills_per_round=skills)
        counts = Counter(s.name for s in slots)
        assert len(slots) == envs
        assert len(counts) == skills, f"round {r} uses {sorted(counts)}"
        assert max(counts.values()) - min(counts.values()) <= 1  # balanced within the round
        assert {s.name for s in round_skills(setting, r, skills)} == set(counts)
        total.update(counts)
    assert set(total) == {s.name for s in skills_for(setting)}  # all six recur
    # 60 rounds are whole cycles of the rotation for these shapes: every skill gets the same count,
    # also when skills_per_round does not divide envs_per_round (the extra slots rotate too).
    assert len(set(total.values())) == 1, total


def test_the_paper_shape_gives_eight_envs_to_each_of_three_skills_and_alternates_halves() -> None:
    first = Counter(s.name for s in assign_round("game", 0, envs_per_round=24, skills_per_round=3))
    second = Counter(s.name for s in assign_round("game", 1, envs_per_round=24, skills_per_round=3))
    assert set(first.values()) == set(second.values()) == {8}
    assert set(first) == {"Mathematical Reasoning", "Logical Deduction", "Spatial Reasoning"}
    assert set(second) == {"Pattern Recognition", "Optimization", "Causal Inference"}
    assert Counter(s.name for s in assign_round("game", 2, envs_per_round=24, skills_per_round=3)) == first


def test_skills_per_round_that_does_not_divide_six_still_walks_through_every_skill() -> None:
    seen = [[s.name for s in round_skills("tool", r, 4)] for r in range(3)]
    assert seen[1] == ["Tool Selection", "Multi-Step Workflows", "API Orchestration", "Data Retrieval"]
    assert {name for names in seen for name in names} == {s.name for s in TOOL_SKILLS}


def test_unknown_setting_and_skill_and_bad_shapes_are_refused_with_the_rule() -> None:
    with pytest.raises(ValueError, match="setting must be 'game' or 'tool', got 'puzzle'"):
        skills_for("puzzle")
    with pytest.raises(ValueError, match="Logical Deduction"):
        skill_named("game", "Chess")
    assert skill_named("tool", "error recovery").name == "Error Recovery"
    with pytest.raises(ValueError, match="envs_per_round"):
        assign_round("game", 0, envs_per_round=-1, skills_per_round=3)
    with pytest.raises(ValueError, match=r"skills_per_round must be in 1\.\.6"):
        round_skills("game", 0, 7)
    with pytest.raises(ValueError, match="round_index"):
        round_skills("game", -1, 3)
