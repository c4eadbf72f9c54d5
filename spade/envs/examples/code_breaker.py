import random
import re
from typing import Any


class CodeBreakerEnv:
    """Crack a hidden 4-digit code (digits 1-6) from exact/misplaced feedback, Mastermind-style."""

    max_turns = 10
    LENGTH = 4
    DIGITS = 6

    def __init__(self) -> None:
        self.rng = random.Random(0)
        self.code: list[int] = []
        self.turn = 0
        self.history: list[tuple[list[int], int, int]] = []

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self.rng = random.Random(seed)
        self.code = [self.rng.randint(1, self.DIGITS) for _ in range(self.LENGTH)]
        self.turn = 0
        self.history = []
        observation = (
            f"A lock has a hidden code of {self.LENGTH} digits, each from 1 to {self.DIGITS} "
            f"(digits may repeat). You have {self.max_turns} guesses. Each guess is scored with "
            "'exact' (right digit in the right place) and 'misplaced' (right digit, wrong place).\n"
            "Action: \\boxed{guess D D D D}, for example \\boxed{guess 1 1 2 2}."
        )
        return observation, {"guesses_left": self.max_turns}

    def _score(self, guess: list[int]) -> tuple[int, int]:
        exact = sum(g == c for g, c in zip(guess, self.code, strict=True))
        common = sum(min(guess.count(d), self.code.count(d)) for d in range(1, self.DIGITS + 1))
        return exact, common - exact

    def _board(self) -> str:
        lines = [f"  {' '.join(map(str, g))}  exact={e} misplaced={m}" for g, e, m in self.history]
        return "Guesses so far:\n" + "\n".join(lines) if lines else "No guesses yet."

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.turn += 1
        left = self.max_turns - self.turn
        match = re.search(r"\\boxed\{\s*guess\s+([1-9](?:[\s,]+[1-9])*)\s*\}", action)
        guess = [int(d) for d in re.findall(r"[1-9]", match.group(1))] if match else []
        if len(guess) != self.LENGTH or any(d > self.DIGITS for d in guess):
            if left <= 0:
                return f"Invalid guess and no guesses left. The code was {self.code}.", 0.0, True, False, {}
            msg = (
                f"Invalid action. Use \\boxed{{guess D D D D}} with {self.LENGTH} digits from 1 to "
                f"{self.DIGITS}. {left} guesses left.\n{self._board()}"
            )
            return msg, 0.0, False, False, {"guesses_left": left}
        exact, misplaced = self._score(guess)
        self.history.append((guess, exact, misplaced))
        if exact == self.LENGTH:
            return f"Correct! The lock opens after {self.turn} guesses.", 1.0, True, False, {}
        if left <= 0:
            return f"Out of guesses. The code was {self.code}.\n{self._board()}", 0.0, True, False, {}
        msg = f"exact={exact} misplaced={misplaced}. {left} guesses left.\n{self._board()}"
        return msg, 0.0, False, False, {"guesses_left": left}

    def solution(self) -> list[str]:
        return ["\\boxed{guess 1 1 2 2}", "\\boxed{guess " + " ".join(map(str, self.code)) + "}"]
