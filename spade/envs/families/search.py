r"""Families with hidden or moving state: find a hidden number, track a walk on a grid."""

from __future__ import annotations

from spade.envs.families.base import Family, Params, choose, lerp, render, tolerance
from spade.envs.types import Setting

HIDDEN = r'''
import random
import re


class $cls:
    """Find a number from 1 to $high in 3 guesses, told higher or lower; the last guess scores by closeness."""

    max_turns = 3

    def reset(self, seed=None):
        self.answer = random.Random(seed).randint(1, $high)
        self.turn = 0
        return (
            "I picked a number from 1 to $high. You have 3 guesses; after a wrong guess I say higher "
            "or lower. Put your guess in \\boxed{}."
        ), {}

    def step(self, action):
        self.turn += 1
        found = re.findall(r"-?\d+", action)
        last = self.turn >= self.max_turns
        if not found:
            return "Put one number in \\boxed{}.", 0.0, last, False, {}
        guess = int(found[-1])
        if guess == self.answer:
            return f"Yes, it is {guess}!", 1.0, True, False, {}
        if last:
            close = max(0.0, 1 - abs(guess - self.answer) / $tol)
            return f"Out of guesses: it was {self.answer}.", round(0.8 * close, 3), True, False, {}
        side = "higher" if guess < self.answer else "lower"
        return f"$no My number is {side} than {guess}.", 0.0, False, False, {}

    def solution(self):
        return [f"\\boxed{{{self.answer}}}"]
'''


def build_hidden(difficulty: float, variant: int) -> tuple[Params, str, str]:
    cls, no, extra = choose(variant, ("HiddenNumberEnv", "GuessEnv", "HigherLowerEnv"), ("No.", "Wrong."), (0, 1, 2))
    high = lerp(30, 200, difficulty) + extra
    params: Params = {"cls": cls, "no": no, "high": high, "tol": round(high * (1 - 0.75 * difficulty))}
    hint = "Guess the middle of the numbers still possible: each 'higher' or 'lower' halves what is left."
    return params, render(HIDDEN, params), hint


GRID = r'''
import random
import re


class $cls:
    """Follow $moves moves of up to $far steps on a grid; closer answers earn partial credit."""

    max_turns = 3
    moves = {"up": (0, 1), "down": (0, -1), "left": (-1, 0), "right": (1, 0)}

    def reset(self, seed=None):
        rng = random.Random(seed)
        x, y = rng.randint(0, 9), rng.randint(0, 9)
        text = f"You are at ({x}, {y}); up adds 1 to y, right adds 1 to x."
        for _ in range($moves):
            name, n = rng.choice(sorted(self.moves)), rng.randint(1, $far)
            x, y = x + self.moves[name][0] * n, y + self.moves[name][1] * n
            text += f" $verb {name} {n}."
        self.answer = (x, y)
        self.turn = 0
        return text + " Where are you now? Answer as \\boxed{x, y}.", {}

    def step(self, action):
        self.turn += 1
        found = [int(n) for n in re.findall(r"-?\d+", action)]
        if len(found) < 2:
            done = self.turn >= self.max_turns
            return "Give two numbers, as \\boxed{x, y}.", 0.0, done, False, {}
        guess = (found[-2], found[-1])
        if guess == self.answer:
            return "Correct!", 1.0, True, False, {}
        off = abs(guess[0] - self.answer[0]) + abs(guess[1] - self.answer[1])
        close = max(0.0, 1 - off / $tol)
        return f"Wrong: you are at {self.answer}.", round(0.8 * close, 3), True, False, {}

    def solution(self):
        return ["\\boxed{%d, %d}" % self.answer]
'''


def build_grid(difficulty: float, variant: int) -> tuple[Params, str, str]:
    cls, verb = choose(variant, ("GridWalkEnv", "WalkEnv", "RobotEnv", "StepsEnv"), ("Move", "Go", "Step"))
    moves, far = lerp(1, 4, difficulty), lerp(1, 3, difficulty)
    params: Params = {"cls": cls, "verb": verb, "moves": moves, "far": far, "tol": tolerance(12, 2, difficulty)}
    hint = "Track x and y separately: right adds to x, left subtracts from x, up adds to y, down subtracts from y."
    return params, render(GRID, params), hint


HIDDEN_FAMILY = Family(
    "hidden_number", Setting.GAME, "Logical Deduction", False,
    "Find a hidden number with higher/lower answers in 3 guesses. Difficulty: the range (1-30 up to 1-200).",
    build_hidden,
)  # fmt: skip
GRID_FAMILY = Family(
    "grid_walk", Setting.GAME, "Spatial Reasoning", True,
    "Say where a walk on a grid ends. Difficulty: number of moves (1-4) and their length (1-3).",
    build_grid,
)  # fmt: skip
