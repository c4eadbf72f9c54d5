import random
import re
from typing import Any


class NumberHuntEnv:
    """Find a hidden number in 1..100 with three guesses; closer final guesses earn partial credit.

    Short on purpose: a small model finishes an episode in three turns, and the graded final reward
    gives the agent a learning signal long before it can win outright.
    """

    max_turns = 3
    low, high = 1, 100

    def __init__(self) -> None:
        self.target = 0
        self.turn = 0
        self.lo, self.hi = self.low, self.high

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        rng = random.Random(seed)
        self.target = rng.randint(self.low, self.high)
        self.turn = 0
        self.lo, self.hi = self.low, self.high
        observation = (
            f"I picked a whole number from {self.low} to {self.high}. You have {self.max_turns} guesses; "
            "after each wrong guess I say whether my number is higher or lower. An exact hit wins; otherwise "
            "your last guess scores by how close it is.\nAction: \\boxed{N}, e.g. \\boxed{20}."
        )
        return observation, {"low": self.low, "high": self.high}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.turn += 1
        boxed = re.search(r"\\boxed\{\s*(-?\d+)\s*\}", action)
        bare = re.search(r"-?\d+", action)
        match = boxed or bare
        guess = None if match is None else int(match.group(1) if boxed else match.group(0))
        last = self.turn >= self.max_turns
        if guess is None:
            if last:
                return "No guess given. Out of guesses.", 0.0, True, False, {}
            return "Give a number, e.g. \\boxed{20}.", 0.0, False, False, {"left": self.max_turns - self.turn}
        if guess == self.target:
            return f"{guess} is right!", 1.0, True, False, {}
        if last:
            closeness = max(0.0, 1.0 - abs(guess - self.target) / (self.high - self.low))
            return (f"Out of guesses: it was {self.target}.", round(0.5 * closeness, 4), True, False, {})
        if guess < self.target:
            self.lo = max(self.lo, guess + 1)
            hint = "higher"
        else:
            self.hi = min(self.hi, guess - 1)
            hint = "lower"
        left = self.max_turns - self.turn
        return (
            f"My number is {hint} than {guess}. It is in {self.lo}..{self.hi}. {left} guess(es) left.",
            0.0,
            False,
            False,
            {"left": left},
        )

    def solution(self) -> list[str]:
        return [f"\\boxed{{{self.target}}}"]
