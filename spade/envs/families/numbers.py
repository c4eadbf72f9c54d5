r"""Number families: one-answer arithmetic games whose wrong answers score by closeness.

Every env asks one question, reads the last number of the reply (no ``\boxed{}`` needed), wins on
the exact number and otherwise ends with 0.8 x closeness; a reply without a number costs a turn.
"""

from __future__ import annotations

from spade.envs.families.base import NUMBER_STEP, Family, Params, choose, lerp, render, tolerance
from spade.envs.types import Setting

HEADER = """
import random
import re


class $cls:
"""

ADD = (
    HEADER
    + r'''    """Add $terms whole numbers from $lo to $hi; a near miss earns partial credit."""

    max_turns = 3

    def reset(self, seed=None):
        rng = random.Random(seed)
        self.nums = [rng.randint($lo, $hi) for _ in range($terms)]
        self.answer = sum(self.nums)
        self.turn = 0
        text = " + ".join(str(n) for n in self.nums)
        return f"$ask {text}? Put the number in \\boxed{{}}.", {}
'''
    + NUMBER_STEP
)


def build_add(difficulty: float, variant: int) -> tuple[Params, str, str]:
    cls, ask, shift = choose(variant, ("AddEnv", "SumEnv", "PlusEnv", "TotalEnv"), ("What is", "Compute"), (0, 1, 2))
    terms = 2 if difficulty < 0.5 else 3 if difficulty < 0.8 else 4
    lo, hi = 1 + shift, lerp(10, 60, difficulty) + shift
    params: Params = {"cls": cls, "ask": ask, "terms": terms, "lo": lo, "hi": hi, "tol": tolerance(30, 4, difficulty)}
    hint = "Add the numbers one at a time from left to right, keeping a running total; box only the total."
    return params, render(ADD, params), hint


NEXT_TERM = (
    HEADER
    + r'''    """Continue an arithmetic sequence ($shown terms shown, steps up to $most); near misses score."""

    max_turns = 3

    def reset(self, seed=None):
        rng = random.Random(seed)
        start, step = rng.randint($lo, $hi), rng.randint(1, $most)
        if rng.random() < $down:
            step = -step
        terms = [start + step * i for i in range($shown)]
        self.answer = start + step * $shown
        self.turn = 0
        shown = ", ".join(str(t) for t in terms)
        return f"$ask {shown}, ... Put the next number in \\boxed{{}}.", {}
'''
    + NUMBER_STEP
)


def build_next_term(difficulty: float, variant: int) -> tuple[Params, str, str]:
    cls, ask, shift = choose(
        variant,
        ("NextTermEnv", "SequenceEnv", "SeriesEnv", "PatternEnv"),
        ("What comes next?", "Continue the sequence:"),
        (0, 2, 4),
    )
    params: Params = {
        "cls": cls,
        "ask": ask,
        "lo": 1 + shift,
        "hi": lerp(20, 80, difficulty) + shift,
        "most": lerp(2, 12, difficulty),
        "down": round(max(0.0, difficulty - 0.5), 2),
        "shown": lerp(5, 3, difficulty),
        "tol": tolerance(20, 3, difficulty),
    }
    hint = "Subtract each term from the one after it: the difference is always the same. Add it to the last term."
    return params, render(NEXT_TERM, params), hint


LARGEST = (
    HEADER
    + r'''    """Pick the $word of $count numbers from $lo to $hi; closer picks earn partial credit."""

    max_turns = 3

    def reset(self, seed=None):
        rng = random.Random(seed)
        self.nums = rng.sample(range($lo, $hi + 1), $count)
        self.answer = $pick(self.nums)
        self.turn = 0
        text = ", ".join(str(n) for n in self.nums)
        return f"Which number is the $word: {text}? Put it in \\boxed{{}}.", {}
'''
    + NUMBER_STEP
)


def build_largest(difficulty: float, variant: int) -> tuple[Params, str, str]:
    cls, (pick, word), shift = choose(
        variant,
        ("LargestEnv", "PickBestEnv", "ExtremeEnv"),
        (("max", "largest"), ("min", "smallest")),
        (0, 5, 10),
    )
    params: Params = {
        "cls": cls,
        "pick": pick,
        "word": word,
        "count": lerp(2, 8, difficulty),
        "lo": 10 + shift,
        "hi": lerp(45, 99, difficulty) + shift,
        "tol": tolerance(60, 5, difficulty),
    }
    keep = "larger" if pick == "max" else "smaller"
    hint = f"Compare the numbers two at a time and keep the {keep} one; the number left at the end is the answer."
    return params, render(LARGEST, params), hint


UNITS = (
    HEADER
    + r'''    """Convert an amount from a big unit to a small one; near misses earn partial credit."""

    max_turns = 3
    units = $units

    def reset(self, seed=None):
        rng = random.Random(seed)
        big, small, factor = rng.choice(self.units)
        amount = rng.randint(2, $most)
        self.answer = amount * factor
        self.turn = 0
        return f"How many {small} are in {amount} {big}? Put the number in \\boxed{{}}.", {}
'''
    + NUMBER_STEP
)

_UNIT_LEVELS = (
    [("weeks", "days", 7), ("dozens", "eggs", 12)],
    [("days", "hours", 24), ("hours", "minutes", 60)],
    [("meters", "centimeters", 100), ("kilograms", "grams", 1000), ("minutes", "seconds", 60)],
)


def build_units(difficulty: float, variant: int) -> tuple[Params, str, str]:
    cls, extra = choose(variant, ("UnitsEnv", "ConvertEnv", "MeasureEnv"), (0, 1, 2, 3))
    level = 0 if difficulty < 0.34 else 1 if difficulty < 0.67 else 2
    most = lerp(12, 25, difficulty) + extra
    units = _UNIT_LEVELS[level]
    widest = most * max(f for *_, f in units)
    params: Params = {
        "cls": cls,
        "units": repr(units),
        "most": most,
        "tol": max(5, round(widest * (0.5 - 0.45 * difficulty))),
    }
    hint = "Multiply the amount by how many small units make one big unit (for example 1 day = 24 hours)."
    return params, render(UNITS, params), hint


MACHINE = (
    HEADER
    + r'''    """A machine maps x to $mul_lo..$mul_hi * x + $add_lo..$add_hi; predict it from two examples."""

    max_turns = 3

    def reset(self, seed=None):
        rng = random.Random(seed)
        mul, add = rng.randint($mul_lo, $mul_hi), rng.randint($add_lo, $add_hi)
        a, b, c = rng.sample(range(1, $top), 3)
        self.answer = mul * c + add
        self.turn = 0
        seen = f"A machine turned {a} into {mul * a + add} and {b} into {mul * b + add}."
        return f"{seen} What does it turn {c} into? Put the number in \\boxed{{}}.", {}
'''
    + NUMBER_STEP
)


def build_machine(difficulty: float, variant: int) -> tuple[Params, str, str]:
    cls, top = choose(variant, ("MachineEnv", "BlackBoxEnv", "RuleEnv"), (12, 13, 14, 15))
    if difficulty < 0.4:  # adds a constant
        mul, add = (1, 1), (3, lerp(10, 20, difficulty / 0.4))
    elif difficulty < 0.75:  # multiplies
        mul, add = (2, lerp(3, 6, (difficulty - 0.4) / 0.35)), (0, 0)
    else:  # multiplies and adds
        mul, add = (2, 5), (1, lerp(5, 15, (difficulty - 0.75) / 0.25))
    params: Params = {
        "cls": cls,
        "mul_lo": mul[0],
        "mul_hi": mul[1],
        "add_lo": add[0],
        "add_hi": add[1],
        "top": top,
        "tol": tolerance(20, 3, difficulty),
    }
    hint = (
        "Compare the two examples: the change in output per unit of input is the multiplier; what is left "
        "after multiplying is the constant added. Apply both to the new input."
    )
    return params, render(MACHINE, params), hint


ADD_FAMILY = Family(
    "add", Setting.GAME, "Mathematical Reasoning", False,
    "Add whole numbers. Difficulty: number of terms (2-4) and their size (up to 15-60).",
    build_add,
)  # fmt: skip
NEXT_TERM_FAMILY = Family(
    "next_term", Setting.GAME, "Pattern Recognition", False,
    "Next term of an arithmetic sequence. Difficulty: start and step size, fewer terms shown, falling sequences.",
    build_next_term,
)  # fmt: skip
LARGEST_FAMILY = Family(
    "largest", Setting.GAME, "Optimization", False,
    "Pick the largest (or smallest) number of a list. Difficulty: list length (2-8) and number range.",
    build_largest,
)  # fmt: skip
UNITS_FAMILY = Family(
    "unit_convert", Setting.GAME, "Mathematical Reasoning", True,
    "Convert an amount to a smaller unit. Difficulty: the conversion factor (7-12, 24-60, 60-1000) and amount.",
    build_units,
)  # fmt: skip
MACHINE_FAMILY = Family(
    "machine", Setting.GAME, "Causal Inference", False,
    "Infer a hidden rule from two input-output examples and predict a third. Difficulty: the rule "
    "(x + k, then k * x, then k * x + b) and the size of k.",
    build_machine,
)  # fmt: skip
