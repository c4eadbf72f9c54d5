"""Token sampling and stop rules: the pure part of generation (no model, no threads).

Logprob convention (SGLang 0.5's default, ``sglang/srt/layers/sampler.py``): the logprob returned
for a sampled token is ``log_softmax(logits / temperature)`` of the *unfiltered* distribution, that
is before top-k/top-p/min-p; under greedy decoding (``temperature == 0``) it is ``log_softmax(logits)``.
A learner that divides its logits by the same temperature reproduces it exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from spade.inference.protocol import SamplingParams

_GREEDY_EPS = 1e-6


def is_greedy(params: SamplingParams) -> bool:
    """Whether ``params`` ask for greedy decoding (temperature 0, or top_k 1)."""
    return params.temperature < _GREEDY_EPS or params.top_k == 1


def sample_tokens(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
) -> list[tuple[int, float]]:
    """Sample one token from each row of ``logits``, row ``i`` under ``params[i]`` with ``generators[i]``.

    One pass over the batch: the log-softmax, the cumulative distribution and the logprob gather are
    batched; per row there is only its filter, when it asks for one (top-k, top-p, min-p), and one
    uniform draw from its own RNG (``generators[i]``: the request's, seeded with ``sampling_seed``;
    None: the global one), turned into a token by inverting the row's cumulative distribution. A
    greedy row draws nothing. The draw is exact: token ``t`` is chosen with probability
    ``p_t / sum(p)`` over the kept tokens, and a token with zero probability never.

    Args:
        logits: ``[rows, vocab]`` float logits for the next position of each row.
        params: each row's sampling parameters.
        generators: each row's RNG.

    Returns:
        ``(token_id, logprob)`` per row, with the logprob convention of this module.

    Raises:
        ValueError: A row has no finite distribution (NaN logits, or every token masked out).
    """
    logits = logits.float()
    greedy = [is_greedy(p) for p in params]
    temperatures = torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)])
    # SGLang: greedy logprobs are untempered, sampled ones tempered and unfiltered.
    logprobs = torch.log_softmax(logits / temperatures.unsqueeze(1), dim=-1)
    tokens = torch.argmax(logits, dim=-1)
    sampled = [i for i, g in enumerate(greedy) if not g]
    if sampled:
        probs = logprobs[sampled].exp()
        for j, i in enumerate(sampled):
            if _filters(params[i]):
                probs[j] = _filtered(probs[j], params[i])
        # float64: the cumulative sum of a 50k-token vocabulary keeps every token's own share.
        cdf = probs.double().cumsum(dim=-1)
        uniforms = torch.cat([torch.rand(1, generator=generators[i], dtype=torch.float64) for i in sampled])
        drawn = torch.searchsorted(cdf, (uniforms * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
        tokens[sampled] = drawn.clamp(max=logits.shape[-1] - 1)
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    if not bool(torch.isfinite(chosen).all()):
        # NaN logits (a diverged update) or a row with no allowed token: no token can be drawn honestly.
        bad = [i for i, ok in enumerate(torch.isfinite(chosen).tolist()) if not ok]
        raise ValueError(f"rows {bad} have no finite distribution to sample from (NaN or all -inf logits)")
    return list(zip(tokens.tolist(), chosen.tolist(), strict=True))


def _filters(params: SamplingParams) -> bool:
    return params.top_k > 0 or params.min_p > 0.0 or params.top_p < 1.0


def _filtered(probs: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``probs`` (one row) with the tokens top-k, min-p and top-p leave out set to zero."""
    keep = torch.ones_like(probs, dtype=torch.bool)
    if params.top_k > 0 and params.top_k < probs.numel():
        kth = torch.topk(probs, params.top_k).values[-1]
        keep &= probs >= kth
    if params.min_p > 0.0:
        keep &= probs >= params.min_p * probs.max()
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop_sorted = (cumulative - sorted_probs) >= params.top_p
        drop = torch.zeros_like(keep)
        drop[order] = drop_sorted
        keep &= ~drop
    return torch.where(keep, probs, torch.zeros_like(probs))


@dataclass(frozen=True)
class StopRule:
    """When a sequence stops, built once per request.

    Attributes:
        stop_token_ids: ids that end the sequence (the EOS ids unless ``ignore_eos``, plus
            ``stop_token_ids``); the matched id is kept in the output.
        stop_strings: strings that end the sequence; the text is cut before them.
        max_new_tokens: the length budget.
    """

    stop_token_ids: frozenset[int]
    stop_strings: tuple[str, ...]
    max_new_tokens: int

    @classmethod
    def build(cls, params: SamplingParams, eos_ids: Sequence[int], max_new_tokens: int) -> StopRule:
        ids = set(params.stop_token_ids or [])
        if not params.ignore_eos:
            ids |= set(eos_ids)
        return cls(frozenset(ids), tuple(params.stop_strings()), max_new_tokens)

    @property
    def tail_tokens(self) -> int:
        """How many trailing tokens to decode to see any stop string whole."""
        return max((len(s) for s in self.stop_strings), default=0) + 8


def finish_for_token(rule: StopRule, token: int, n_generated: int) -> dict[str, object] | None:
    """The SGLang ``finish_reason`` after ``token`` (the ``n_generated``-th token), if it ends the sequence."""
    if token in rule.stop_token_ids:
        return {"type": "stop", "matched": token}
    if n_generated >= rule.max_new_tokens:
        return {"type": "length", "length": n_generated}
    return None


def matched_stop_string(rule: StopRule, tail_text: str) -> str | None:
    """The first stop string found in the decoded tail of the output, if any."""
    for s in rule.stop_strings:
        if s in tail_text:
            return s
    return None


def trim_at_stop(text: str, stop: str) -> str:
    """``text`` cut before the first occurrence of ``stop`` (SGLang's stop trimming)."""
    index = text.find(stop)
    return text if index < 0 else text[:index]
