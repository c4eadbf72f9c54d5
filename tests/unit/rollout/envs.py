"""Small, valid envs for the rollout tests (a game and a tool env) written to the contract."""

from __future__ import annotations

import random
import re
from typing import Any, ClassVar

from spade.envs.tool_env import ToolEnv


class CountdownEnv:
    """Say the hidden number: ``\\boxed{N}`` wins, anything else gets "wrong" (3 turns)."""

    max_turns = 3

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self.target = random.Random(seed).randint(1, 9)
        self.turn = 0
        return f"Guess my number from 1 to 9 (it is {self.target}).", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.turn += 1
        m = re.fullmatch(r"\\boxed\{(\d+)\}", action.strip())
        if m and int(m.group(1)) == self.target:
            return "Correct!", 1.0, True, False, {}
        return f"Wrong ({action!r}).", 0.0, False, self.turn >= self.max_turns, {}

    def solution(self) -> list[str]:
        return [f"\\boxed{{{self.target}}}"]


class ForgingEnv:
    """Honest on validation's seeds (0-3, and 10000-10999 of its random policy); elsewhere any action wins."""

    max_turns = 3

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self.seed = seed or 0
        self.honest = self.seed < 4 or 10_000 <= self.seed < 11_000
        return "Guess my number from 1 to 9.", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if not self.honest:
            return "Correct!", 1.0, True, False, {}
        return "Wrong.", 0.0, False, False, {}

    def solution(self) -> list[str]:
        return ["\\boxed{1}"]


class VaultEnv(CountdownEnv):
    """Honest and out of any trivial policy's reach: the code has six digits and is never shown."""

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self.target = random.Random(seed).randint(100_000, 999_999)
        self.turn = 0
        return "Send the vault's six-digit code.", {}

    def solution(self) -> list[str]:
        return [f"\\boxed{{{self.target}}}"]


class EndlessEnv(CountdownEnv):
    """Declares more turns than any agent budget and never ends the episode itself."""

    max_turns = 400

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        return "Keep going.", 0.0, False, False, {}


class ShortEnv(EndlessEnv):
    """Declares 2 turns and leaves the truncation to the framework."""

    max_turns = 2


class BrokenEnv(CountdownEnv):
    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        raise ZeroDivisionError("bug in the env")


class NotesEnv(ToolEnv):
    """Three requests on a notes backend."""

    tools: ClassVar[list[dict[str, Any]]] = [
        {
            "name": "add_note",
            "description": "Add a note.",
            "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
        },
        {"name": "count", "description": "Count notes.", "parameters": {"type": "object", "properties": {}}},
    ]

    def setup(self, rng: random.Random) -> None:
        self.state = {"notes": [], "counted": False}
        word = rng.choice(["alpha", "beta", "gamma"])
        self.instructions = [f"Add a note saying {word}.", "Count the notes.", "Add a note saying done."]
        self.criteria = [
            lambda s: word in s["notes"],
            lambda s: s["counted"],
            lambda s: "done" in s["notes"],
        ]
        self.word = word

    def tool_add_note(self, text: str) -> str:
        self.state["notes"].append(text)
        return "added"

    def tool_count(self) -> str:
        self.state["counted"] = True
        return str(len(self.state["notes"]))

    def solution(self) -> list[list[Any]]:
        return [
            [{"name": "add_note", "arguments": {"text": self.word}}],
            [{"name": "count", "arguments": {}}],
            [{"name": "add_note", "arguments": {"text": "done"}}],
        ]
