"""Prompt-lookup drafts and their verification: what is drafted, and that kept-or-redrawn tokens have
exactly the sampler's distribution."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from services.inference.sampling import row_distribution
from services.inference.speculative import PromptLookup, accept_or_sample
from spade.inference.protocol import SamplingParams


def test_the_longest_matching_ngram_drafts_what_followed_it_last() -> None:
    # "2 3" followed by 9 at the start, by 4 later; the 3-gram "1 2 3" only at the start.
    lookup = PromptLookup([1, 2, 3, 9, 9, 7, 2, 3, 4, 5, 1, 2, 3])
    assert lookup.draft(2) == [9, 9]  # the 3-gram's continuation wins over the later 2-gram's
    lookup = PromptLookup([2, 3, 9, 9, 7, 2, 3, 4, 5, 8, 2, 3])
    assert lookup.draft(3) == [4, 5, 8]  # of two occurrences, the most recent


def test_a_draft_is_cut_to_k_and_to_what_exists() -> None:
    lookup = PromptLookup([4, 5, 6, 4])
    assert lookup.draft(1) == [5]
    assert lookup.draft(10) == [5, 6, 4]
    assert lookup.draft(0) == []
    assert PromptLookup([1, 2, 3]).draft(4) == []  # nothing repeats
    assert PromptLookup([]).draft(4) == []


def test_extending_indexes_the_new_tokens_and_copies_are_independent() -> None:
    lookup = PromptLookup([7, 8])
    twin = lookup.copy()
    lookup.extend([9, 7])
    assert lookup.draft(3) == [8, 9, 7]
    assert twin.draft(3) == []
    twin.extend([1, 7])
    assert twin.draft(2) == [8, 1]
    assert lookup.tokens == [7, 8, 9, 7] and twin.tokens == [7, 8, 1, 7]


LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


def _emitted(params: SamplingParams, proposal: int | None, draws: int = 8_000) -> Counter[int]:
    generator = torch.Generator().manual_seed(1)
    counts: Counter[int] = Counter()
    for _ in range(draws):
        token, _, kept = accept_or_sample(LOGITS, params, generator, proposal)
        assert kept == (token == proposal)
        counts[token] += 1
    return counts


@pytest.mark.parametrize("proposal", [0, 3, 5, None])
@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0), SamplingParams(temperature=0.6), SamplingParams(temperature=1.0, top_p=0.8)],
)
def test_kept_or_redrawn_tokens_have_the_samplers_distribution(params: SamplingParams, proposal: int | None) -> None:
    """Whatever is proposed, a likely token, an unlikely one or one the filter removes, the emitted token
    is distributed as plain sampling's (total variation under 0.03 over 8,000 seeded draws)."""
    _, probs = row_distribution(LOGITS, params)
    assert probs is not None
    expected = (probs / probs.sum()).tolist()
    counts = _emitted(params, proposal)
    total = sum(counts.values())
    distance = 0.5 * sum(abs(counts[t] / total - p) for t, p in enumerate(expected))
    assert distance < 0.03, (counts, expected)
    for token, p in enumerate(expected):
        if p == 0.0:
            assert counts[token] == 0, f"token {token} was filtered out but emitted"


def test_a_drafted_token_is_kept_as_often_as_the_sampler_would_draw_it() -> None:
    params = SamplingParams(temperature=1.0)
    _, probs = row_distribution(LOGITS, params)
    assert probs is not None
    counts = _emitted(params, 1)
    assert counts[1] / sum(counts.values()) == pytest.approx(float(probs[1] / probs.sum()), abs=0.01)


def test_the_logprob_follows_the_samplers_convention() -> None:
    """Tempered and before top-k (SGLang's convention), whether the token was the kept draft or redrawn."""
    params = SamplingParams(temperature=0.5, top_k=2)
    expected = torch.log_softmax(LOGITS / 0.5, dim=-1)
    seen = set()
    for seed in range(40):
        token, logprob, kept = accept_or_sample(LOGITS, params, torch.Generator().manual_seed(seed), 0)
        assert logprob == pytest.approx(float(expected[token]))
        seen.add(kept)
    assert seen == {True, False}


def test_greedy_keeps_a_draft_exactly_when_it_is_the_argmax() -> None:
    greedy = SamplingParams(temperature=0.0)
    assert accept_or_sample(LOGITS, greedy, None, 0)[::2] == (0, True)
    token, logprob, kept = accept_or_sample(LOGITS, greedy, None, 2)
    assert (token, kept) == (0, False)
    assert logprob == pytest.approx(float(torch.log_softmax(LOGITS, dim=-1)[0]))


def test_a_position_with_no_allowed_token_is_refused() -> None:
    masked = torch.full((6,), float("-inf"))
    with pytest.raises(ValueError, match="no finite distribution"):
        accept_or_sample(masked, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0), 2)
