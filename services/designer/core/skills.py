"""The six skills of each setting and their rotation over a regeneration batch.

Skills steer what the designer writes (DESIGN §1). Every batch cycles through all six skills of its
setting; the starting skill advances from batch to batch so that a batch smaller than six still
covers every skill over consecutive batches.

>>> [s.name for s in assign_skills("game", 3, batch_index=1)]
['Pattern Recognition', 'Optimization', 'Causal Inference']
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Setting = Literal["game", "tool"]
SETTINGS: tuple[Setting, ...] = ("game", "tool")


@dataclass(frozen=True)
class Skill:
    """A skill the designed environment should exercise.

    Attributes:
        name: Display name, stored with the environment and used for per-skill reward centering.
        description: One sentence telling the designer what the skill means in its setting.
    """

    name: str
    description: str


GAME_SKILLS: tuple[Skill, ...] = (
    Skill(
        "Mathematical Reasoning",
        "the player must compute, estimate or prove quantities (arithmetic, algebra, number theory, "
        "probability) to choose winning actions",
    ),
    Skill(
        "Logical Deduction",
        "the player narrows down a hidden configuration from clues and feedback by eliminating possibilities",
    ),
    Skill(
        "Spatial Reasoning",
        "the player reasons about positions, paths, shapes or moves on a grid, graph or geometric layout",
    ),
    Skill(
        "Pattern Recognition",
        "the player infers a hidden rule, sequence or regularity from observations and exploits it",
    ),
    Skill(
        "Optimization",
        "the player must reach a goal within a budget (moves, cost, resources) by choosing efficient actions",
    ),
    Skill(
        "Causal Inference",
        "the player runs interventions, observes their effects and infers which hidden causes drive the system",
    ),
)

TOOL_SKILLS: tuple[Skill, ...] = (
    Skill(
        "API Orchestration",
        "the agent chains several tools, feeding the output of one call into the arguments of the next",
    ),
    Skill(
        "Data Retrieval",
        "the agent searches, filters and looks up records to find the exact items an instruction refers to",
    ),
    Skill(
        "State Modification",
        "the agent creates, updates or deletes backend records so the state matches each instruction",
    ),
    Skill(
        "Error Recovery",
        "some calls fail with clear errors (missing records, invalid values, conflicts) and the agent "
        "must diagnose and recover",
    ),
    Skill(
        "Tool Selection",
        "several similar or distracting tools exist and the agent must pick the right one with the right arguments",
    ),
    Skill(
        "Multi-Step Workflows",
        "each instruction needs an ordered sequence of dependent calls that together complete a workflow",
    ),
)

SKILLS: dict[Setting, tuple[Skill, ...]] = {"game": GAME_SKILLS, "tool": TOOL_SKILLS}


def skills_for(setting: str) -> tuple[Skill, ...]:
    """The six skills of ``setting``.

    Raises:
        ValueError: ``setting`` is not ``"game"`` or ``"tool"``.
    """
    if setting not in SKILLS:
        raise ValueError(f"unknown setting {setting!r}: expected one of {', '.join(SETTINGS)}")
    return SKILLS[setting]


def skill_named(setting: str, name: str) -> Skill:
    """Look a skill up by its display name (case-insensitive).

    Raises:
        ValueError: no skill of ``setting`` has that name; the message lists the valid names.
    """
    for skill in skills_for(setting):
        if skill.name.lower() == name.strip().lower():
            return skill
    names = ", ".join(s.name for s in skills_for(setting))
    raise ValueError(f"unknown {setting} skill {name!r}: expected one of {names}")


def assign_skills(setting: str, count: int, *, batch_index: int = 0) -> list[Skill]:
    """Skills for the ``count`` environment slots of one batch, round-robin.

    Args:
        setting: ``"game"`` or ``"tool"``.
        count: Number of environments in the batch (>= 0).
        batch_index: Index of the regeneration batch; the rotation starts at skill
            ``batch_index * count`` so consecutive small batches walk through all six skills.

    Returns:
        One skill per slot; every skill appears ``count // 6`` or ``count // 6 + 1`` times.
    """
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    skills = skills_for(setting)
    start = (batch_index * count) % len(skills)
    return [skills[(start + i) % len(skills)] for i in range(count)]
