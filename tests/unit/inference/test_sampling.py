"""Sampling and stop rules: the pure part of generation."""

from __future__ import annotations

import pytest
import torch

from services.inference.sampling import (
    StopRule,
    finish_for_token,
    matched_stop_string,
    sample_tokens,
    trim_at_stop,
)
from spade.inference.protocol import SamplingParams


def sample_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> tuple[int, float]:
    """One row through the engine's batched sampler."""
    return sample_tokens(logits.unsqueeze(0), [params], [generator])[0]


LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


def test_greedy_takes_the_argmax_with_the_untempered_logprob() -> None:
    token, logprob = sample_token(LOGITS, SamplingParams(temperature=0.0))
    assert token == 0
    assert abs(logprob - float(torch.log_softmax(LOGITS, -1)[0])) < 1e-7


def test_sampled_logprob_is_tempered_and_unfiltered() -> None:
    params = SamplingParams(temperature=0.5, top_k=3)
    token, logprob = sample_token(LOGITS, params, torch.Generator().manual_seed(0))
    assert abs(logprob - float(torch.log_softmax(LOGITS / 0.5, -1)[token])) < 1e-7


def test_top_k_top_p_and_min_p_restrict_the_support() -> None:
    gen = torch.Generator().manual_seed(1)
    top_k = {sample_token(LOGITS, SamplingParams(top_k=2), gen)[0] for _ in range(300)}
    assert top_k == {0, 1}
    # p(token 0) ≈ 0.56 at T=1: a 0.5 nucleus holds only it; 0.7 adds token 1.
    assert {sample_token(LOGITS, SamplingParams(top_p=0.5), gen)[0] for _ in range(200)} == {0}
    assert {sample_token(LOGITS, SamplingParams(top_p=0.7), gen)[0] for _ in range(300)} == {0, 1}
    # min_p 0.3: keeps tokens with p >= 0.3 * p_max, i.e. tokens 0 and 1 (0.37 ratio) but not 2 (0.22).
    assert {sample_token(LOGITS, SamplingParams(min_p=0.3), gen)[0] for _ in range(300)} == {0, 1}


def test_seeded_generators_reproduce_samples() -> None:
    params = SamplingParams(temperature=1.5)
    a = [sample_token(LOGITS, params, g)[0] for g in [torch.Generator().manual_seed(5)] for _ in range(50)]
    b = [sample_token(LOGITS, params, g)[0] for g in [torch.Generator().manual_seed(5)] for _ in range(50)]
    assert a == b and len(set(a)) > 1


def test_draws_follow_the_tempered_distribution() -> None:
    # 40,000 seeded draws at T = 0.8: every token's frequency within 4.5 standard errors of its probability.
    params, n = SamplingParams(temperature=0.8), 40_000
    gen = torch.Generator().manual_seed(11)
    counts = torch.bincount(torch.tensor([sample_token(LOGITS, params, gen)[0] for _ in range(n)]), minlength=6)
    probs = torch.softmax(LOGITS / 0.8, -1)
    error = (probs * (1 - probs) / n).sqrt()
    assert ((counts / n - probs).abs() <= 4.5 * error + 1e-9).all(), (counts / n, probs)
    # ...and a token the filter leaves out is never drawn, however many draws.
    kept = {sample_token(LOGITS, SamplingParams(temperature=5.0, top_k=3), gen)[0] for _ in range(3000)}
    assert kept == {0, 1, 2}


def test_a_batch_draws_what_each_row_draws_alone() -> None:
    rows = torch.stack([LOGITS, LOGITS.flip(0), LOGITS * 0.5, LOGITS])
    params = [SamplingParams(temperature=1.2), SamplingParams(temperature=0.0), SamplingParams(top_p=0.7),
              SamplingParams(temperature=0.6)]  # fmt: skip
    batch_gens = [torch.Generator().manual_seed(s) for s in (1, 2, 3, 1)]
    alone_gens = [torch.Generator().manual_seed(s) for s in (1, 2, 3, 1)]
    for _ in range(30):
        batch = sample_tokens(rows, params, batch_gens)
        alone = [sample_token(rows[i], params[i], alone_gens[i]) for i in range(4)]
        assert [t for t, _ in batch] == [t for t, _ in alone]
        for (_, a), (_, b) in zip(batch, alone, strict=True):
            assert abs(a - b) < 1e-6
    # The greedy row took the argmax of its own row, untempered, and drew nothing from its RNG.
    assert batch[1][0] == 5 and abs(batch[1][1] - float(torch.log_softmax(LOGITS.flip(0), -1)[5])) < 1e-6
    assert torch.equal(batch_gens[1].get_state(), torch.Generator().manual_seed(2).get_state())


def test_a_row_without_a_finite_distribution_is_refused_not_sampled() -> None:
    params = [SamplingParams(temperature=0.7), SamplingParams(temperature=0.7)]
    gens = [torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)]
    nan = torch.stack([LOGITS, torch.full_like(LOGITS, float("nan"))])
    with pytest.raises(ValueError, match=r"rows \[1\]"):
        sample_tokens(nan, params, gens)
    masked = torch.stack([torch.full_like(LOGITS, float("-inf")), LOGITS])  # a grammar allowing nothing
    with pytest.raises(ValueError, match=r"rows \[0\]"):
        sample_tokens(masked, params, gens)


def test_stop_rules() -> None:
    rule = StopRule.build(SamplingParams(stop_token_ids=[7], stop=["</answer>"]), eos_ids=[2], max_new_tokens=4)
    assert finish_for_token(rule, 2, 1) == {"type": "stop", "matched": 2}
    assert finish_for_token(rule, 7, 1) == {"type": "stop", "matched": 7}
    assert finish_for_token(rule, 5, 3) is None
    assert finish_for_token(rule, 5, 4) == {"type": "length", "length": 4}
    assert matched_stop_string(rule, "x</answer") is None
    assert matched_stop_string(rule, "x</answer>y") == "</answer>"
    assert trim_at_stop("42</answer>tail", "</answer>") == "42"
    assert rule.tail_tokens >= len("</answer>")


def test_ignore_eos_drops_only_the_eos() -> None:
    rule = StopRule.build(SamplingParams(ignore_eos=True, stop_token_ids=[9]), eos_ids=[2], max_new_tokens=8)
    assert finish_for_token(rule, 2, 1) is None
    assert finish_for_token(rule, 9, 1) == {"type": "stop", "matched": 9}
