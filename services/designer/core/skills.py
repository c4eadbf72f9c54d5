"""The six skills of each setting and their rotation over regeneration rounds (DESIGN §5).

Skills steer what the designer writes (DESIGN §1). As in the paper, a round writes
``envs_per_round`` environments over ``skills_per_round`` of the six skills (paper: 24 over 3, so 8
per skill): round ``r`` uses skills ``(r * s + j) mod 6`` for ``j < s``, so consecutive rounds walk
through all six and every skill recurs; the round's slots go round-robin over its skills. The
learner centres designer rewards within (round, skill), so each skill of a round holds several envs.

>>> [s.name for s in round_skills("game", 1, 3)]
['Pattern Recognition', 'Optimization', 'Causal Inference']
>>> [s.name[:4] for s in assign_round("game", 0, envs_per_round=5, skills_per_round=2)]
['Math', 'Logi', 'Math', 'Logi', 'Math']
"""

from __future__ import annotations

from dataclasses import dataclass

from spade.envs.types import Setting


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

SKILLS: dict[Setting, tuple[Skill, ...]] = {Setting.GAME: GAME_SKILLS, Setting.TOOL: TOOL_SKILLS}


def skills_for(setting: str) -> tuple[Skill, ...]:
    """The six skills of ``setting``.

    Raises:
        ValueError: ``setting`` is not ``"game"`` or ``"tool"``.
    """
    return SKILLS[Setting.parse(setting)]


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


def round_skills(setting: str, round_index: int, skills_per_round: int) -> list[Skill]:
    """The skills of round ``round_index``: ``(round_index * skills_per_round + j) mod 6``, ``j < s``.

    Raises:
        ValueError: ``round_index`` is negative or ``skills_per_round`` is not in ``1..6``.
    """
    skills = skills_for(setting)
    if round_index < 0:
        raise ValueError(f"round_index must be >= 0, got {round_index}")
    if not 1 <= skills_per_round <= len(skills):
        raise ValueError(f"skills_per_round must be in 1..{len(skills)}, got {skills_per_round}")
    start = round_index * skills_per_round
    return [skills[(start + j) % len(skills)] for j in range(skills_per_round)]


def assign_round(setting: str, round_index: int, *, envs_per_round: int, skills_per_round: int) -> list[Skill]:
    """One skill per slot of round ``round_index``: round-robin over the round's skills.

    Every skill of the round gets ``envs_per_round // skills_per_round`` or one more slot. The
    round-robin continues from where the previous rounds left it (a global slot counter), so when
    ``skills_per_round`` does not divide ``envs_per_round`` the extra slots go to a different skill
    from round to round instead of always to the round's first.

    Raises:
        ValueError: ``envs_per_round`` is negative, or see :func:`round_skills`.
    """
    if envs_per_round < 0:
        raise ValueError(f"envs_per_round must be >= 0, got {envs_per_round}")
    skills = round_skills(setting, round_index, skills_per_round)
    first = round_index * envs_per_round
    return [skills[(first + slot) % len(skills)] for slot in range(envs_per_round)]
