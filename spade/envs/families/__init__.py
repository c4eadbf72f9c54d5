r"""Environment families: parameterised generators of valid envs with a difficulty knob (DESIGN §5,
"Small models: families, warm start, no idle steps").

Each family writes complete standalone env programs, exactly as the designer must write one
(standard library only, one ``*Env`` class, ``reset``/``step``/``solution``, ``max_turns = 3``),
with its parameters baked in as literals, plus a hint. Returns are graded: a win is 1.0, a near
miss earns partial credit in (0, 1), a reply with nothing parsable earns 0 — so a group of plays
has variance even when a small agent never wins outright. Envs are lenient about the answer's form:
the last number (or word) of the reply counts when there is no ``\boxed{}``.

They are the seed pool, the fixed-env baseline and the designer warm start's material; families
with ``held_out=True`` are kept out of all three for clean evaluation.

>>> env = FAMILIES["add"].generate(0.5, variant=1)
>>> env.name, env.setting, env.skill
('add-d0.50-v1', 'game', 'Mathematical Reasoning')
>>> env.code.startswith("import random")
True

As a designer answer (what the warm start trains on): ``spade.inference.answer_format.designer_answer``.

Standard library only: ``spade/envs`` is copied into the sandbox.
"""

from __future__ import annotations

from spade.envs.families.base import Family, FamilyEnv
from spade.envs.families.numbers import ADD_FAMILY, LARGEST_FAMILY, MACHINE_FAMILY, NEXT_TERM_FAMILY, UNITS_FAMILY
from spade.envs.families.search import GRID_FAMILY, HIDDEN_FAMILY
from spade.envs.families.words import ECHO_FAMILY, PICK_FAMILY
from spade.envs.types import Setting

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        ECHO_FAMILY,
        PICK_FAMILY,
        LARGEST_FAMILY,
        ADD_FAMILY,
        NEXT_TERM_FAMILY,
        MACHINE_FAMILY,
        HIDDEN_FAMILY,
        UNITS_FAMILY,
        GRID_FAMILY,
    )
}
"""Every family by name."""


def _of(setting: str, held_out: bool) -> list[Family]:
    if setting not in tuple(Setting):
        raise ValueError(f"setting must be 'game' or 'tool', got {setting!r}")
    return [f for f in FAMILIES.values() if f.setting == setting and f.held_out is held_out]


def training_families(setting: str = Setting.GAME) -> list[Family]:
    """The families of ``setting`` that training may use (not held out), in registry order."""
    return _of(setting, held_out=False)


def held_out_families(setting: str = Setting.GAME) -> list[Family]:
    """The families of ``setting`` kept out of every training use, for evaluation."""
    return _of(setting, held_out=True)


def spread(count: int) -> list[float]:
    """``count`` difficulties spread evenly over [0.1, 0.9] (one: 0.5).

    >>> spread(1), spread(3)
    ([0.5], [0.1, 0.5, 0.9])
    """
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    if count == 1:
        return [0.5]
    return [round(0.1 + 0.8 * i / (count - 1), 2) for i in range(count)]


def seed_pool_envs(setting: str = Setting.GAME, per_family: int = 3) -> list[FamilyEnv]:
    """``per_family`` envs of every training family of ``setting``, at difficulties ``spread(per_family)``
    (variant 0), family by family."""
    return [f.generate(d) for f in training_families(setting) for d in spread(per_family)]


__all__ = [
    "FAMILIES",
    "Family",
    "FamilyEnv",
    "held_out_families",
    "seed_pool_envs",
    "spread",
    "training_families",
]
