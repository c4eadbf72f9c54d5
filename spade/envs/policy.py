r"""Random and no-op actions for an env, with no knowledge of the instance being played.

The checker uses them to test that winning is not trivial (``random_policy``), that episodes end
(``termination``) and to probe instances (``determinism``, ``seed_variety``). Game: commands from
other instances' solutions, ``\boxed{...}`` commands shown in the current observation
(placeholders filled at random), random numbers and noise. Tool: calls from other instances'
solutions, random calls built from the tool schemas, plain replies, malformed calls. Standard
library only.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from typing import Any

from spade.envs.actions import ToolCall, find_boxed
from spade.envs.schema import example_value
from spade.envs.types import Setting

NOOP_GAME_ACTION = "\\boxed{pass}"
NOOP_TOOL_ACTION = "Okay."
_PLACEHOLDER = re.compile(r"^(?:[A-Z]|N\d*|<[^>]*>|\.\.\.)$")


def noop_action(setting: Setting) -> str:
    """The do-nothing action of a setting."""
    return NOOP_GAME_ACTION if setting is Setting.GAME else NOOP_TOOL_ACTION


def _strings_in(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings_in(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings_in(v)]
    return []


class RandomPolicy:
    """Draws random actions for one env (see the module docstring).

    Args:
        setting: game or tool.
        rng: the policy's own RNG (the global ``random`` module is never used).
        other_solutions: ``solution()`` results of *other* instances (game: action lists; tool:
            lists of ``ToolCall`` blocks), so no action leaks the played instance's answer.
        tools: the tool schemas by name (tool setting).
    """

    def __init__(self, setting: Setting, rng: random.Random, other_solutions: list[Any], tools: dict[str, Any]) -> None:
        self.setting = setting
        self.rng = rng
        self.tools = tools
        self.actions: list[str] = []
        self.strings: list[str] = []
        for solution in other_solutions:
            if setting is Setting.GAME:
                self.actions += [a for a in solution if isinstance(a, str)]
            else:
                for call in (c for block in solution for c in block):
                    self.actions.append(call.to_text())
                    self.strings += _strings_in(call.arguments)

    def _fill(self, command: str) -> str:
        words = []
        for word in command.split():
            if "|" in word and word != "|":
                words.append(self.rng.choice([w for w in word.split("|") if w] or [word]))
            elif _PLACEHOLDER.match(word):
                words.append(str(self.rng.randint(1, 9)))
            else:
                words.append(word)
        return " ".join(words)

    def action(self, observation: str) -> str:
        """A random action given the current observation."""
        rng = self.rng
        if self.setting is Setting.GAME:
            shown = find_boxed(observation)
            choices: list[Callable[[], str]] = [
                lambda: f"\\boxed{{{rng.randint(0, 100)}}}",
                lambda: rng.choice(["I am not sure.", "\\boxed{}", NOOP_GAME_ACTION]),
            ]
            if shown:
                choices += [lambda: "\\boxed{" + self._fill(rng.choice(shown)) + "}"] * 2
            if self.actions:
                choices += [lambda: rng.choice(self.actions)] * 2
            return rng.choice(choices)()
        calls: list[Callable[[], str]] = [
            lambda: rng.choice(["I cannot help with that.", NOOP_TOOL_ACTION]),
            lambda: '<tool_call>{"name": "' + rng.choice([*self.tools, "unknown"]) + '", "arguments": [}</tool_call>',
        ]
        if self.tools:
            calls += [self._random_call] * 3
        if self.actions:
            calls += [lambda: rng.choice(self.actions)] * 3
        return rng.choice(calls)()

    def _random_call(self) -> str:
        name = self.rng.choice(sorted(self.tools))
        arguments = example_value(self.tools[name]["parameters"], self.rng, self.strings)
        return ToolCall(name, arguments if isinstance(arguments, dict) else {}).to_text()
