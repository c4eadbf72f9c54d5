r"""What every environment family is made of: ``FamilyEnv``, ``Family`` and the program skeletons.

A family turns ``(difficulty, variant)`` into the literals of one standalone env program (standard
library only, one ``*Env`` class), exactly as the designer has to write one. The literals are
substituted into a short template (``string.Template``: ``$name`` placeholders, so the program's own
braces need no escaping), which keeps every generated program a plain, readable file and makes
different literals give different code text (so different content hashes in the memory).

Standard library only: ``spade/envs`` is copied into the sandbox.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from string import Template
from typing import Any

Params = dict[str, int | float | str]
Builder = Callable[[float, int], tuple[Params, str, str]]
"""``(difficulty, variant) -> (params, code, hint)``: one family's generator."""


@dataclass(frozen=True)
class FamilyEnv:
    """One generated env: its program, its hint and the literals that made it.

    Attributes:
        family: The family's name.
        difficulty: The difficulty it was generated at, in [0, 1] (rounded to 2 decimals).
        params: The literals baked into ``code`` (names as in the program, values as written there).
        setting: ``"game"`` or ``"tool"``.
        skill: The skill it exercises (DESIGN §1 skill lists).
        code: The complete program (no leading or trailing blank lines, as the designer's parser
            extracts it).
        hint: The privileged hint: a key insight, never the answer.
        variant: The variant it was generated with (secondary literals: class name, wording, ranges).
    """

    family: str
    difficulty: float
    params: Params
    setting: str
    skill: str
    code: str
    hint: str
    variant: int = 0

    @property
    def name(self) -> str:
        """``<family>-d<difficulty>-v<variant>``, e.g. ``add-d0.50-v3``.

        Params are a function of ``(family, difficulty, variant)``, so different params always give
        different names. Two nearby difficulties can round to the same literals: their programs are
        then identical, and the memory stores them once (it deduplicates by content).
        """
        return f"{self.family}-d{self.difficulty:.2f}-v{self.variant}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "family": self.family,
            "difficulty": self.difficulty,
            "variant": self.variant,
            "params": dict(self.params),
            "setting": self.setting,
            "skill": self.skill,
            "code": self.code,
            "hint": self.hint,
        }


@dataclass(frozen=True)
class Family:
    """A parameterised generator of valid envs with a difficulty knob and graded returns.

    Attributes:
        name: Registry key.
        setting: ``"game"`` or ``"tool"``.
        skill: The skill its envs exercise.
        held_out: Kept out of every training use (seed pool, warm start, fixed-env baseline), for
            clean evaluation.
        description: What the env asks and what the difficulty controls.
        builder: ``(difficulty, variant) -> (params, code, hint)``.
    """

    name: str
    setting: str
    skill: str
    held_out: bool
    description: str
    builder: Builder = field(repr=False, compare=False)

    def generate(self, difficulty: float, variant: int = 0) -> FamilyEnv:
        """The env at ``difficulty`` (0 easiest, 1 hardest) and ``variant`` (secondary literals).

        Deterministic in ``(difficulty, variant)``; the difficulty is rounded to 2 decimals first.

        Raises:
            ValueError: ``difficulty`` outside [0, 1] or a negative ``variant``.
        """
        if not 0.0 <= difficulty <= 1.0:
            raise ValueError(f"difficulty must be in [0, 1], got {difficulty!r}")
        if isinstance(variant, bool) or not isinstance(variant, int) or variant < 0:
            raise ValueError(f"variant must be an int >= 0, got {variant!r}")
        level = round(float(difficulty), 2)
        params, code, hint = self.builder(level, variant)
        return FamilyEnv(self.name, level, params, self.setting, self.skill, code, hint, variant)


def lerp(low: float, high: float, difficulty: float) -> int:
    """The integer ``difficulty`` of the way from ``low`` to ``high``.

    >>> lerp(10, 20, 0.0), lerp(10, 20, 0.5), lerp(10, 20, 1.0)
    (10, 15, 20)
    """
    return round(low + (high - low) * difficulty)


def tolerance(wide: int, narrow: int, difficulty: float) -> int:
    """How far off a wrong answer may be and still earn something: ``wide`` at difficulty 0,
    shrinking to ``narrow`` at 1, so harder envs also demand more precision for partial credit.

    >>> tolerance(30, 4, 0.0), tolerance(30, 4, 1.0)
    (30, 4)
    """
    return lerp(wide, narrow, difficulty)


def tries(difficulty: float) -> int:
    """Answers allowed (the env's ``max_turns``): 3 below difficulty 0.4, 2 below 0.7, then 1.

    >>> tries(0.1), tries(0.5), tries(0.9)
    (3, 2, 1)
    """
    return 3 if difficulty < 0.4 else 2 if difficulty < 0.7 else 1


def choose(variant: int, *options: Sequence[Any]) -> tuple[Any, ...]:
    """One item of each option list, read off ``variant`` as a mixed-radix number.

    Different variants give different tuples until the product of the list lengths is reached.

    >>> choose(0, "ab", "xyz"), choose(1, "ab", "xyz"), choose(2, "ab", "xyz")
    (('a', 'x'), ('b', 'x'), ('a', 'y'))
    """
    picked = []
    for items in options:
        picked.append(items[variant % len(items)])
        variant //= len(items)
    return tuple(picked)


def render(template: str, params: Params) -> str:
    """``template`` with each ``$name`` replaced by ``params[name]``: numbers as their ``repr``,
    strings as they are (the template quotes them where they are string literals, and uses them
    bare where they are names, like the class name). Surrounding blank lines are dropped.

    >>> render("x = $n\\nname = '$word'", {"n": 3, "word": "owl"})
    "x = 3\\nname = 'owl'"
    """
    values = {k: v if isinstance(v, str) else repr(v) for k, v in params.items()}
    return Template(template).substitute(values).strip()


NUMBER_STEP = r"""
    def step(self, action):
        self.turn += 1
        found = re.findall(r"-?\d+", action)
        if not found:
            done = self.turn >= self.max_turns
            return "Put one number in \\boxed{}.", 0.0, done, False, {}
        guess = int(found[-1])
        if guess == self.answer:
            return f"Correct, it is {guess}!", 1.0, True, False, {}
        close = max(0.0, 1 - abs(guess - self.answer) / $tol)
        return f"Wrong: it was {self.answer}.", round(0.8 * close, 3), True, False, {}

    def solution(self):
        return [f"\\boxed{{{self.answer}}}"]
"""
"""``step``/``solution`` of a one-answer numeric game: the last number of the reply is the answer
(no box needed); exact wins, otherwise 0.8 x closeness (``$tol`` or more apart scores 0); a reply
without a number costs a turn."""
