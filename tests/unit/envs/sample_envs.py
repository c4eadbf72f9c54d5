"""Small, valid env sources that tests mutate into one defect each."""

from __future__ import annotations

GUESS_GAME = r"""
import random
import re


class GuessEnv:
    max_turns = 12

    def __init__(self):
        self.rng = random.Random(0)
        self.secret = 0
        self.turn = 0

    def reset(self, seed=None):
        self.rng = random.Random(seed)
        self.secret = self.rng.randint(1, 1000)
        self.turn = 0
        return "Guess my number from 1 to 1000. Reply \\boxed{N}; I say higher or lower.", {}

    def step(self, action):
        self.turn += 1
        match = re.search(r"\\boxed\{(\d+)\}", action)
        if match is None:
            obs = "Reply with \\boxed{N}."
        elif int(match.group(1)) == self.secret:
            return "Correct!", 1.0, True, False, {}
        else:
            obs = "higher" if int(match.group(1)) < self.secret else "lower"
        if self.turn >= self.max_turns:
            return obs + " Out of turns.", 0.0, False, True, {}
        return obs, 0.0, False, False, {"turn": self.turn}

    def solution(self):
        return ["\\boxed{500}", "\\boxed{" + str(self.secret) + "}"]
"""

NOTES_TOOL = r"""
import random

from spade.envs import ToolEnv

TOPICS = ["budget", "hiring", "roadmap", "offsite", "security", "pricing", "launch", "support"]


class NotesEnv(ToolEnv):
    max_turns = 10
    tools = [
        {
            "name": "add_note",
            "description": "Create a note.",
            "parameters": {
                "type": "object",
                "properties": {
                    "title": {"type": "string"},
                    "body": {"type": "string"},
                    "meta": {
                        "type": "object",
                        "properties": {
                            "tags": {"type": "array", "items": {"type": "string", "enum": ["work", "home"]}},
                            "pinned": {"type": "boolean"},
                        },
                        "required": ["tags"],
                    },
                },
                "required": ["title", "body", "meta"],
            },
        },
        {
            "name": "delete_note",
            "description": "Delete a note by title.",
            "parameters": {"type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"]},
        },
        {
            "name": "search",
            "description": "Search notes by word.",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
        },
        {
            "name": "get_time",
            "description": "Current time.",
            "parameters": {"type": "object", "properties": {}},
        },
    ]

    def setup(self, rng):
        a, b, c = rng.sample(TOPICS, 3)
        self.a, self.b, self.c = a, b, c
        self.state = {"notes": {c: {"body": "old", "meta": {"tags": ["home"]}}}, "searched": [], "touched": False}
        self.instructions = [
            f"Create a note '{a}' saying 'draft' tagged work.",
            f"Create a pinned note '{b}' saying 'final' tagged home.",
            f"Delete the note '{c}'.",
        ]
        self.criteria = [
            lambda s: s["notes"].get(a) == {"body": "draft", "meta": {"tags": ["work"]}},
            lambda s: s["notes"].get(b) == {"body": "final", "meta": {"tags": ["home"], "pinned": True}},
            lambda s: c not in s["notes"],
        ]

    def tool_add_note(self, title, body, meta):
        self.state["touched"] = True
        self.state["notes"][title] = {"body": body, "meta": meta}
        return f"Saved {title}."

    def tool_delete_note(self, title):
        self.state["touched"] = True
        if self.state["notes"].pop(title, None) is None:
            raise KeyError(f"no note {title!r}")
        return f"Deleted {title}."

    def tool_search(self, query):
        self.state["touched"] = True
        self.state["searched"].append(query)
        return sorted(t for t, n in self.state["notes"].items() if query in t or query in n["body"])

    def tool_get_time(self):
        self.state["touched"] = True
        return "12:00"

    def solution(self):
        return [
            [{"name": "add_note", "arguments": {"title": self.a, "body": "draft", "meta": {"tags": ["work"]}}}],
            [{"name": "add_note",
              "arguments": {"title": self.b, "body": "final", "meta": {"tags": ["home"], "pinned": True}}}],
            [{"name": "delete_note", "arguments": {"title": self.c}}],
        ]
"""


def mutate(code: str, old: str, new: str) -> str:
    """``code`` with ``old`` replaced by ``new`` (which must occur: a silent no-op would hide a bug)."""
    assert old in code, f"mutation target not found: {old!r}"
    return code.replace(old, new)
