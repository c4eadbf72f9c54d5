r"""Word families: copy a made-up word, name the word at a position in a list.

The answer is the last word of the reply (``\boxed{}`` not required); wrong answers score by how
close they are (letters in common; distance along the list).
"""

from __future__ import annotations

from spade.envs.families.base import Family, Params, choose, lerp, render, tries
from spade.envs.types import Setting

ECHO = r'''
import difflib
import random
import re


class $cls:
    """Echo a made-up word of $syllables syllables ($how), among the last $window words of a reply; $tries tries."""

    max_turns = $tries

    def reset(self, seed=None):
        rng = random.Random(seed)
        self.word = "".join(rng.choice("$consonants") + rng.choice("aeiou") for _ in range($syllables))
        self.answer = self.word[::$step]
        self.turn = 0
        self.ask = f"The word is {self.word}. $task"
        return self.ask, {}

    def step(self, action):
        self.turn += 1
        words = re.findall(r"[a-z]+", action.lower().replace("\\boxed", " "))[-$window:]
        if self.answer in words:
            return "Exactly right!", 1.0, True, False, {}
        if self.turn < self.max_turns:
            return f"Not quite. {self.ask}", 0.0, False, False, {}
        close = max((difflib.SequenceMatcher(None, w, self.answer).ratio() for w in words), default=0.0)
        return f"Not quite: it was {self.answer}.", round(0.8 * close**$sharp, 3), True, False, {}

    def solution(self):
        return [f"\\boxed{{{self.answer}}}"]
'''


def build_echo(difficulty: float, variant: int) -> tuple[Params, str, str]:
    backwards = difficulty >= 0.7
    if backwards:
        tasks = ("Write it backwards.", "Spell it backwards.")
    elif difficulty < 0.4:  # the word again, last: what a small model copies best
        tasks = ("Repeat it: {self.word}", "Copy it: {self.word}")
    else:
        tasks = ("Repeat it.", "Copy it.")
    cls, consonants, task = choose(
        variant,
        ("EchoEnv", "CopyWordEnv", "RepeatEnv"),
        ("bdfgklmnprstvz", "bcdghjklmnprstw", "bdfklmnprstvwz"),
        tasks,
    )
    params: Params = {
        "cls": cls,
        "task": task,
        "how": "backwards" if backwards else "as it is",
        "consonants": consonants,
        "syllables": lerp(2, 5, difficulty),
        "step": -1 if backwards else 1,
        "tries": tries(difficulty),
        "window": 50 if difficulty < 0.4 else 2 if difficulty < 0.7 else 1,
        "sharp": lerp(1, 3, difficulty),
    }
    if backwards:
        hint = "Read the word from its last letter to its first; box only the reversed word."
    else:
        hint = "Copy the word letter by letter; box only that word."
    return params, render(ECHO, params), hint


PICK = r'''
import random
import re


class $cls:
    """Name the word at position $first..$count of a list of $count; other list words earn partial credit."""

    max_turns = 3
    words = "$words".split()

    def reset(self, seed=None):
        rng = random.Random(seed)
        self.items = rng.sample(self.words, $count)
        self.pos = rng.randint($first, $count)
        self.answer = self.items[self.pos - 1]
        self.turn = 0
        listing = ", ".join(f"{i}. {w}" for i, w in enumerate(self.items, 1))
        return f"List: {listing}. Which word is number {self.pos}? Put it in \\boxed{{}}.", {}

    def step(self, action):
        self.turn += 1
        words = [w for w in re.findall(r"[a-z]+", action.lower()) if w in self.items]
        if not words:
            done = self.turn >= self.max_turns
            return "Answer with one word from the list.", 0.0, done, False, {}
        if words[-1] == self.answer:
            return "Correct!", 1.0, True, False, {}
        off = abs(self.items.index(words[-1]) + 1 - self.pos)
        return f"Wrong: it was {self.answer}.", round(0.6 * (1 - off / $count), 3), True, False, {}

    def solution(self):
        return [f"\\boxed{{{self.answer}}}"]
'''

_VOCABULARIES = (
    "apple bread chair cloud drum egg fork goat hat kite lamp leaf moon nest owl pear ring rose "
    "ship sock star tree wolf", "bell boat cake coin desk door fish frog gate horn jar key lion "
    "map milk nut pen rain road seed snow tent vase", "ant bear bike book bowl cup duck fan fox "
    "glove hill ink lake mint net oak pig plum rope sun toy van worm",
)  # fmt: skip


def build_pick(difficulty: float, variant: int) -> tuple[Params, str, str]:
    cls, words = choose(variant, ("PickItemEnv", "ListEnv", "NthWordEnv", "PositionEnv"), _VOCABULARIES)
    count = lerp(2, 9, difficulty)
    params: Params = {"cls": cls, "words": words, "count": count, "first": lerp(count, 1, difficulty)}
    hint = "Count along the list from 1 and stop at the number asked; answer with that word only."
    return params, render(PICK, params), hint


ECHO_FAMILY = Family(
    "echo", Setting.GAME, "Pattern Recognition", False,
    "Copy a made-up word, then (difficulty 0.7 and up) write it backwards. Difficulty: word length "
    "(2-5 syllables), where in the reply the word must be (anywhere, the last 2 words, the last word), "
    "tries (3, 2, 1), how close a miss must be to score.",
    build_echo,
)  # fmt: skip
PICK_FAMILY = Family(
    "pick_item", Setting.GAME, "Spatial Reasoning", False,
    "Name the word at a position in a numbered list (the last word of the reply that is in the list "
    "counts). Difficulty: list length (2-9) and which positions are asked (the last one only, up to any).",
    build_pick,
)  # fmt: skip
