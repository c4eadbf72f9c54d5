import random
import re
from typing import Any


class SequenceOracleEnv:
    """Query terms of a hidden integer sequence, then predict the next three terms after term 10."""

    max_turns = 8

    def __init__(self) -> None:
        self.rng = random.Random(0)
        self.kind = "quadratic"
        self.params: list[int] = []
        self.turn = 0
        self.revealed: dict[int, int] = {}

    def _term(self, n: int) -> int:
        if self.kind == "quadratic":
            a, b, c = self.params
            return a * n * n + b * n + c
        if self.kind == "recurrence":  # t(n) = p*t(n-1) + q*t(n-2), t(1), t(2) given
            p, q, t1, t2 = self.params
            prev, cur = t1, t2
            if n == 1:
                return t1
            for _ in range(n - 2):
                prev, cur = cur, p * cur + q * prev
            return cur
        a, r = self.params  # interleaved: odd terms grow by a, even terms are multiplied by r
        return a * (n + 1) // 2 if n % 2 else r ** (n // 2)

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self.rng = random.Random(seed)
        self.kind = self.rng.choice(["quadratic", "recurrence", "interleaved"])
        if self.kind == "quadratic":
            self.params = [self.rng.randint(1, 4), self.rng.randint(-5, 5), self.rng.randint(-9, 9)]
        elif self.kind == "recurrence":
            self.params = [
                self.rng.randint(1, 3),
                self.rng.randint(-2, 2),
                self.rng.randint(1, 5),
                self.rng.randint(1, 9),
            ]
        else:
            self.params = [self.rng.randint(2, 9), self.rng.randint(2, 3)]
        self.turn = 0
        self.revealed = {n: self._term(n) for n in (1, 2, 3)}
        observation = (
            "A hidden integer sequence t(1), t(2), ... follows a fixed rule. Known terms: "
            + self._known()
            + f". You have {self.max_turns} turns. Ask for any term t(n) with 4 <= n <= 10, or give "
            "t(11), t(12), t(13) to win (one attempt).\n"
            "Actions: \\boxed{term 7} or \\boxed{answer 11 12 13} (your three numbers)."
        )
        return observation, {"known": dict(self.revealed)}

    def _known(self) -> str:
        return ", ".join(f"t({n})={v}" for n, v in sorted(self.revealed.items()))

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.turn += 1
        left = self.max_turns - self.turn
        inner = re.search(r"\\boxed\{(.*)\}", action, re.DOTALL)
        command = inner.group(1).strip().lower() if inner else ""
        answer = re.fullmatch(r"answer\s+(-?\d+)[\s,]+(-?\d+)[\s,]+(-?\d+)", command)
        if answer:
            guess = [int(g) for g in answer.groups()]
            truth = [self._term(n) for n in (11, 12, 13)]
            if guess == truth:
                return "Correct: the rule is cracked.", 1.0, True, False, {}
            return f"Wrong: t(11..13) = {truth}.", 0.0, True, False, {}
        term = re.fullmatch(r"term\s+(\d+)", command)
        if term and 4 <= int(term.group(1)) <= 10:
            n = int(term.group(1))
            self.revealed[n] = self._term(n)
            msg = f"t({n}) = {self.revealed[n]}. Known: {self._known()}."
        else:
            msg = "Invalid action. Use \\boxed{term N} with 4 <= N <= 10 or \\boxed{answer A B C}."
        if left <= 0:
            return msg + " Out of turns.", 0.0, False, True, {}
        return msg + f" {left} turns left.", 0.0, False, False, {"known": dict(self.revealed)}

    def solution(self) -> list[str]:
        truth = " ".join(str(self._term(n)) for n in (11, 12, 13))
        return ["\\boxed{term 4}", "\\boxed{term 5}", "\\boxed{answer " + truth + "}"]
