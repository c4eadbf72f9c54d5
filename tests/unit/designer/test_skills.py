"""Skill tables and their rotation over regeneration batches."""

from __future__ import annotations

from collections import Counter

import pytest

from services.designer.core.skills import GAME_SKILLS, TOOL_SKILLS, assign_skills, skill_named, skills_for


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
def test_a_batch_spreads_its_slots_evenly_over_the_skills(setting: str) -> None:
    counts = Counter(s.name for s in assign_skills(setting, 14))
    assert len(counts) == 6
    assert set(counts.values()) == {2, 3}


def test_small_batches_walk_through_every_skill_over_consecutive_batches() -> None:
    seen = [s.name for index in range(3) for s in assign_skills("game", 2, batch_index=index)]
    assert sorted(seen) == sorted(s.name for s in GAME_SKILLS)


def test_unknown_setting_and_skill_are_refused_with_the_valid_names() -> None:
    with pytest.raises(ValueError, match="game, tool"):
        skills_for("puzzle")
    with pytest.raises(ValueError, match="Logical Deduction"):
        skill_named("game", "Chess")
    assert skill_named("tool", "error recovery").name == "Error Recovery"
    with pytest.raises(ValueError, match="count"):
        assign_skills("game", -1)
