"""What the suites need from the model, as a small protocol and plain values.

The adapter (``services/eval/model.py``) implements :class:`ChatModel` over the project's inference
client; suites never see HTTP, and a test can drive a suite's loop with a scripted model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from spade.envs.actions import ToolCallParse


class PromptRejected(Exception):
    """The server refused this prompt (too long for the model's context): the item scores 0.

    Not an infrastructure failure: the same prompt is refused every time, so the item is judged
    failed (with the reason recorded) rather than retried forever.
    """


@dataclass(frozen=True)
class Reply:
    """One model turn.

    Attributes:
        text: What the model said (special tokens removed).
        tool_calls: The tool calls found in ``text`` by the project's parser.
        finish_reason: ``stop``, ``length`` or ``abort``.
        prompt_tokens: Length of the prompt the model saw.
        output_tokens: Tokens generated.
    """

    text: str
    tool_calls: ToolCallParse = field(default_factory=lambda: ToolCallParse([], [], ""))
    finish_reason: str = "stop"
    prompt_tokens: int = 0
    output_tokens: int = 0


class ChatModel(Protocol):
    """A chat model behind the inference client."""

    async def reply(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        key: str,
        turn: int = 0,
    ) -> Reply:
        """One reply to ``messages`` (with ``tools`` offered, if any).

        Args:
            messages: OpenAI-style chat messages.
            tools: OpenAI function schemas offered to the model.
            key: The item's id; with ``turn`` it fixes the sampling seed, so a rerun (or another
                checkpoint) draws the same random numbers for the same item.
            turn: The model turn within the item, from 0.

        Raises:
            PromptRejected: The server refused the prompt (e.g. longer than the context).
        """
        ...
