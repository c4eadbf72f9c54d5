"""The words the agent sees around an env's observations.

>>> first_game_message("3 coins left.", "Leave a multiple of 4.").splitlines()[-1]
'HINT: Leave a multiple of 4.'
"""

from __future__ import annotations

GAME_INSTRUCTIONS = (
    "You are playing a text game, one turn at a time. Read the observation, think briefly, and end "
    "your reply with exactly one action written as \\boxed{...} (for example \\boxed{move left}). "
    "Only the last \\boxed{...} of your reply is played."
)


def first_game_message(observation: str, hint: str | None) -> str:
    """The first user turn of a game play: the instructions, the observation and, if hinted, the hint."""
    text = f"{GAME_INSTRUCTIONS}\n\nObservation:\n{observation}"
    return with_hint(text, hint)


def with_hint(text: str, hint: str | None) -> str:
    """Append the privileged hint to the first observation (hinted plays only)."""
    if hint is None:
        return text
    return f"{text}\n\nHINT: {hint}"
