"""The model as the suites see it: the project's inference client, its chat template and tool parser.

Prompts are built client-side with the model's own chat template (``InferenceClient``'s formatter,
which also describes tools to templates that ignore them) and generated through SGLang's
``/generate``; tool calls are read from the reply by ``spade.envs.actions.parse_tool_calls``, the
parser the rollout uses. Each request carries a ``sampling_seed`` derived from the eval's seed, the
item and the turn, so an item draws the same random numbers on every run and every checkpoint; and,
with ``batch_invariant``, asks for the server's batch-invariant mode, so the numbers it draws from do
not depend on what else the server computes at the time (how many items run at once, other tenants).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from services.eval.core.ports import PromptRejected, Reply
from spade.envs.actions import parse_tool_calls
from spade.inference.client import InferenceClient, InferenceRequestError
from spade.inference.protocol import SamplingParams, ServerInfo
from spade.inference.seeds import derive_sampling_seed


class Invariance(enum.StrEnum):
    """Whether an eval's replies are batch-invariant (independent of what else the server computes)."""

    OFF = "off"
    """Not asked for (``batch_invariant`` off)."""
    SERVER = "server"
    """The server computes every request batch-invariantly (SGLang's ``--enable-deterministic-inference``)."""
    PER_REQUEST = "per-request"
    """The server honours the eval's per-request ``custom_params.batch_invariant`` (the embedded server)."""
    UNSUPPORTED = "unsupported"
    """Asked for, but the server cannot honour it: replies may depend on the concurrency."""


def invariance_of(requested: bool, servers: Sequence[ServerInfo | None]) -> Invariance:
    """What the eval gets from ``servers`` (each worker's ``/get_server_info``; None: it has none).

    >>> invariance_of(True, [ServerInfo(enable_deterministic_inference=True)])
    <Invariance.SERVER: 'server'>
    >>> invariance_of(True, [ServerInfo(batch_invariant_requests=True), None])
    <Invariance.UNSUPPORTED: 'unsupported'>
    """
    if not requested:
        return Invariance.OFF
    if servers and all(s is not None and s.enable_deterministic_inference for s in servers):
        return Invariance.SERVER
    honoured = [s is not None and (s.enable_deterministic_inference or s.batch_invariant_requests) for s in servers]
    if servers and all(honoured):
        return Invariance.PER_REQUEST
    return Invariance.UNSUPPORTED


@dataclass(frozen=True)
class Sampling:
    """Sampling settings of every generation of one eval run (recorded in its header).

    Attributes:
        temperature: Softmax temperature; 0 is greedy.
        top_p: Nucleus mass.
        max_new_tokens: Tokens one reply may generate.
        batch_invariant: Whether the replies are batch-invariant, and how (every request asks for
            the mode unless it is ``OFF``).
    """

    temperature: float
    top_p: float
    max_new_tokens: int
    batch_invariant: Invariance = Invariance.OFF

    @property
    def asks_invariance(self) -> bool:
        """Whether each request asks for the batch-invariant mode."""
        return self.batch_invariant is not Invariance.OFF

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready mapping."""
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "max_new_tokens": self.max_new_tokens,
            "batch_invariant": self.batch_invariant.value,
        }


class ClientChatModel:
    """:class:`services.eval.core.ports.ChatModel` over an :class:`InferenceClient`.

    Args:
        client: A client with a tokenizer (its formatter applies the chat template).
        sampling: Sampling of every reply.
        run_key: Names the run's sampling seeds (suite and seed), so two runs of the same suite and
            seed draw the same numbers per item.
    """

    def __init__(self, client: InferenceClient, sampling: Sampling, run_key: str) -> None:
        self.client = client
        self.sampling = sampling
        self.run_key = run_key

    async def reply(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        key: str,
        turn: int = 0,
    ) -> Reply:
        """Generate one reply (see :meth:`services.eval.core.ports.ChatModel.reply`)."""
        prompt_ids = self.client.apply_chat_template(messages, tools)
        params = SamplingParams(
            max_new_tokens=self.sampling.max_new_tokens,
            temperature=self.sampling.temperature,
            top_p=self.sampling.top_p,
            sampling_seed=derive_sampling_seed(self.run_key, key, "eval", 0, "eval", turn),
        )
        if self.sampling.asks_invariance:
            params = params.with_batch_invariance()
        try:
            gen = await self.client.generate(prompt_ids, params, return_logprob=False)
        except InferenceRequestError as exc:
            if exc.status in (400, 413, 422):
                raise PromptRejected(
                    f"the server refused a prompt of {len(prompt_ids)} tokens (HTTP {exc.status}: {exc.detail[:200]})"
                ) from None
            raise
        return Reply(
            text=gen.text,
            tool_calls=parse_tool_calls(gen.text),
            finish_reason=str(getattr(gen.finish_reason, "value", gen.finish_reason)),
            prompt_tokens=len(prompt_ids),
            output_tokens=len(gen.output_ids),
        )
