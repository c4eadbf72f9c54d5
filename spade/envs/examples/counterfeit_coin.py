import random
import re
from typing import Any


class CounterfeitCoinEnv:
    """Find the one counterfeit coin (heavier or lighter) with at most three balance weighings."""

    max_turns = 5
    WEIGHINGS = 3

    def __init__(self) -> None:
        self.rng = random.Random(0)
        self.n = 0
        self.fake = 0
        self.heavy = True
        self.weighings = 0
        self.turn = 0
        self.log: list[str] = []

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self.rng = random.Random(seed)
        self.n = self.rng.randint(8, 12)
        self.fake = self.rng.randint(1, self.n)
        self.heavy = self.rng.random() < 0.5
        self.weighings = 0
        self.turn = 0
        self.log = []
        observation = (
            f"There are {self.n} coins numbered 1..{self.n}. Exactly one is counterfeit: it is either "
            f"heavier or lighter than the others, you do not know which. You may use a balance scale at "
            f"most {self.WEIGHINGS} times, then name the coin and whether it is heavy or light.\n"
            "Actions: \\boxed{weigh 1 2 3 | 4 5 6} (left | right pans, same number of coins) or "
            "\\boxed{answer 5 heavy} / \\boxed{answer 5 light} (ends the game)."
        )
        return observation, {"weighings_left": self.WEIGHINGS}

    def _weigh(self, left: list[int], right: list[int]) -> str:
        def weight(coins: list[int]) -> float:
            return sum((1.1 if self.heavy else 0.9) if c == self.fake else 1.0 for c in coins)

        a, b = weight(left), weight(right)
        return "balance" if abs(a - b) < 1e-9 else ("left heavier" if a > b else "right heavier")

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.turn += 1
        out_of_turns = self.turn >= self.max_turns
        inner = re.search(r"\\boxed\{(.*)\}", action, re.DOTALL)
        command = inner.group(1).strip().lower() if inner else ""
        answer = re.fullmatch(r"answer\s+(\d+)\s+(heavy|light)", command)
        if answer:
            coin, kind = int(answer.group(1)), answer.group(2)
            if coin == self.fake and (kind == "heavy") == self.heavy:
                return f"Correct: coin {coin} is {kind}.", 1.0, True, False, {}
            truth = "heavy" if self.heavy else "light"
            return f"Wrong: the counterfeit was coin {self.fake} ({truth}).", 0.0, True, False, {}
        weigh = re.fullmatch(r"weigh\s+([\d\s,]+)\|([\d\s,]+)", command)
        if weigh and self.weighings < self.WEIGHINGS:
            left = [int(c) for c in re.findall(r"\d+", weigh.group(1))]
            right = [int(c) for c in re.findall(r"\d+", weigh.group(2))]
            coins = left + right
            if len(left) == len(right) and len(set(coins)) == len(coins) and all(1 <= c <= self.n for c in coins):
                self.weighings += 1
                result = self._weigh(left, right)
                self.log.append(f"{left} vs {right}: {result}")
                left_n = self.WEIGHINGS - self.weighings
                msg = f"Weighing {self.weighings}: {result}. {left_n} weighings left.\n" + "\n".join(self.log)
                return msg, 0.0, False, out_of_turns, {"weighings_left": left_n}
        if weigh and self.weighings >= self.WEIGHINGS:
            msg = "No weighings left: give your \\boxed{answer N heavy|light}."
        else:
            msg = (
                "Invalid action. Use \\boxed{weigh A B | C D} with the same number of distinct coins "
                f"(1..{self.n}) on each pan, or \\boxed{{answer N heavy|light}}."
            )
        if out_of_turns:
            return msg + " Out of turns.", 0.0, False, True, {}
        return msg, 0.0, False, False, {}

    def solution(self) -> list[str]:
        other = 1 if self.fake != 1 else 2
        kind = "heavy" if self.heavy else "light"
        return [f"\\boxed{{weigh {self.fake} | {other}}}", f"\\boxed{{answer {self.fake} {kind}}}"]
