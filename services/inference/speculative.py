"""Prompt-lookup speculative decoding: drafts from a sequence's own tokens, verified by the model.

A designer answer is Python that re-uses the prompt's example env and memory examples (class
skeletons, method names, the answer format's markers) and its own earlier lines. So the tokens that
follow the sequence's last few tokens have often already followed them once, earlier in the prompt or
the output. :class:`PromptLookup` proposes those tokens as a draft (SGLang's and vLLM's ``ngram``
speculative algorithm; "prompt lookup decoding"), and the engine feeds the draft through the model in
the same forward pass as the row's next token (``1 + k`` query positions a row instead of one; on a
CPU a pass over a few more positions costs little more than one, since the pass reads all the weights
either way).

:func:`accept_or_sample` then decides each drafted token by speculative sampling with a deterministic
draft: token ``d`` is kept with the probability the sampler gives it, ``p(d)``; at the first one
refused, the token is drawn from ``p`` without ``d`` (renormalized); after a fully kept draft one more
token is drawn from the last position. Every emitted token therefore has exactly the distribution
plain sampling gives it (greedy: the argmax, drafted or not), with the same logprob convention
(``services.inference.sampling``); only the random numbers consumed differ, so a seeded request
stays reproducible with drafting on, but draws other tokens than with drafting off.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from services.inference.sampling import is_greedy, row_distribution
from spade.inference.protocol import SamplingParams

#: The longest and shortest n-gram a draft is looked up by (the longest match found wins).
MAX_NGRAM = 3
MIN_NGRAM = 1


class PromptLookup:
    """A sequence's tokens, indexed by their n-grams, drafting the tokens that followed the latest match.

    The index maps each n-gram (``MIN_NGRAM`` to ``MAX_NGRAM`` tokens) to where it last ended, so
    appending a token and drafting cost O(1) whatever the length.

    >>> lookup = PromptLookup([5, 6, 7, 8, 9, 5, 6])
    >>> lookup.draft(3)
    [7, 8, 9]
    >>> lookup.extend([7, 1])
    >>> lookup.draft(2)  # no earlier occurrence of "7 1" or "1"
    []
    """

    def __init__(self, tokens: Sequence[int]) -> None:
        self.tokens: list[int] = []
        self._ends: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def copy(self) -> PromptLookup:
        """An independent copy (the ``n`` samples of one prompt each draft from their own tokens)."""
        twin = PromptLookup(())
        twin.tokens, twin._ends = list(self.tokens), dict(self._ends)
        return twin

    def extend(self, tokens: Sequence[int]) -> None:
        """Append ``tokens`` (the sequence as generated)."""
        for token in tokens:
            end = len(self.tokens)
            # Every n-gram ending here is now followed by ``token``: it can be drafted from.
            for n in range(MIN_NGRAM, MAX_NGRAM + 1):
                if end >= n:
                    self._ends[tuple(self.tokens[end - n : end])] = end
            self.tokens.append(int(token))

    def draft(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest matching suffix."""
        if k <= 0:
            return []
        length = len(self.tokens)
        for n in range(MAX_NGRAM, MIN_NGRAM - 1, -1):
            if length < n:
                continue
            end = self._ends.get(tuple(self.tokens[length - n :]))
            if end is not None:
                return self.tokens[end : end + k]
        return []


def accept_or_sample(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None, proposal: int | None
) -> tuple[int, float, bool]:
    """The token at one position, given the draft's ``proposal`` for it (None: no draft left).

    Args:
        logits: ``[vocab]`` logits of the position (a grammar's mask already applied).
        params: The row's sampling parameters.
        generator: The row's RNG (None: the global one).
        proposal: The drafted token, or None after the draft (then this is a plain draw).

    Returns:
        ``(token, logprob, kept)``: ``kept`` when ``token`` is the proposal (the next position's draft
        may be tried), with the logprob convention of :mod:`services.inference.sampling`.

    Raises:
        ValueError: The position has no finite distribution (NaN logits, or every token masked out).
    """
    logprobs, probs = row_distribution(logits, params)
    if is_greedy(params):
        token = int(torch.argmax(logits).item())
    else:
        assert probs is not None
        total = float(probs.sum().item())
        if not total > 0.0:
            raise ValueError("no finite distribution to sample from (NaN or all -inf logits)")
        if proposal is not None:
            uniform = float(torch.rand(1, generator=generator, dtype=torch.float64).item())
            if uniform * total < float(probs[proposal].item()):
                return proposal, float(logprobs[proposal].item()), True
            probs = probs.clone()
            probs[proposal] = 0.0
        token = _draw(probs, generator)
    logprob = float(logprobs[token].item())
    if not math.isfinite(logprob):
        raise ValueError("no finite distribution to sample from (NaN or all -inf logits)")
    return token, logprob, token == proposal


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token with probability ``probs[t] / sum(probs)`` (float64 cumulative sum, as the batched sampler)."""
    cdf = probs.double().cumsum(dim=-1)
    if not float(cdf[-1].item()) > 0.0:
        raise ValueError("no token left to draw (every token refused or masked out)")
    uniform = torch.rand(1, generator=generator, dtype=torch.float64)
    token = int(torch.searchsorted(cdf, uniform * cdf[-1], right=True).item())
    return min(token, probs.numel() - 1)
