"""Prompt-lookup speculative decoding: drafts from a sequence's own tokens, verified by the model.

A designer answer is Python that re-uses the prompt's example env and memory examples (class
skeletons, method names, the answer format's markers) and its own earlier lines. So the tokens that
follow the sequence's last few tokens have often already followed them once, earlier in the prompt or
the output. :class:`PromptLookup` proposes those tokens as a draft (SGLang's and vLLM's ``ngram``
speculative algorithm; "prompt lookup decoding"), and the engine feeds the draft through the model in
the same forward pass as the row's next token (``1 + k`` query positions a row instead of one; on a
CPU a pass over a few more positions costs little more than one, since the pass reads all the weights
either way).

Verification samples each position exactly as plain decoding samples it (the same sampler, the row's
own generator, one draw a position) and keeps the draft for as long as the drawn token is the drafted
one; the first token that differs is kept too and ends the step. A drafted token is therefore kept
with the probability the sampler gives it, and every emitted token is the token plain decoding would
have drawn from the same logits with the same random numbers: a seeded request gives the same tokens
with drafting as without (up to the float rounding a pass of another shape brings, as batching does),
with the same logprobs.
"""

from __future__ import annotations

from collections.abc import Sequence

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
