"""The policy as the core sees it: the inference client's chat formatter and ``/generate``.

Thin adapters over ``spade.inference``: the formatter is the model's own chat template (with its
handling of templates that ignore tools), and generation is SGLang's token-in/token-out
``/generate`` with logprobs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from spade.agent.ports import TurnSampling
from spade.inference.chat import ChatFormatter
from spade.inference.client import InferenceClient
from spade.inference.protocol import SamplingParams


class FormatterTemplate:
    """``ChatFormatter`` as the core's ``ChatTemplate``."""

    def __init__(self, formatter: ChatFormatter) -> None:
        self._formatter = formatter
        self._tok = formatter.tokenizer

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None,
        generation_prompt: bool,
    ) -> str:
        """Render with the model's template."""
        return self._formatter.render(messages, tools, add_generation_prompt=generation_prompt)

    def encode(self, text: str) -> list[int]:
        """Ids of rendered text; special-token markers in it become their single ids."""
        return [int(i) for i in self._tok.encode(text, add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        """Text including special tokens."""
        return self._formatter.decode(ids, skip_special_tokens=False)

    def decode_reply(self, ids: Sequence[int]) -> str:
        """Text without special tokens: what the model said."""
        return self._formatter.decode(ids, skip_special_tokens=True)


@dataclass(frozen=True)
class Generation:
    """A generation with its weight version as an int (SGLang reports it as a string)."""

    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    weight_version: int | None


def parse_version(value: object) -> int | None:
    """SGLang's ``weight_version`` string as an int (None when absent or not a number).

    >>> parse_version("7"), parse_version(None), parse_version("default")
    (7, None, None)
    """
    try:
        return int(str(value))
    except ValueError:
        return None


class InferenceGenerator:
    """``InferenceClient.generate`` as the core's ``Generator``.

    Args:
        client: The inference client (one or several workers).
        stop_token_ids: Extra token ids that end a turn (the model's EOS always does).
    """

    def __init__(self, client: InferenceClient, stop_token_ids: Sequence[int] = ()) -> None:
        self._client = client
        self._stop = list(stop_token_ids) or None

    async def generate(self, input_ids: list[int], sampling: TurnSampling) -> Generation:
        """Sample one turn with logprobs (seeded with SGLang's ``sampling_seed`` when the turn has one)."""
        params = SamplingParams(
            max_new_tokens=sampling.max_new_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            stop_token_ids=self._stop,
            sampling_seed=sampling.seed,
        )
        gen = await self._client.generate(input_ids, params, return_logprob=True)
        return Generation(
            output_ids=list(gen.output_ids),
            logprobs=list(gen.logprobs),
            finish_reason=str(gen.finish_reason),
            weight_version=parse_version(gen.weight_version),
        )
