"""Sampling and stop rules: the pure part of generation."""

from __future__ import annotations

import torch

from services.inference.sampling import StopRule, finish_for_token, matched_stop_string, sample_token, trim_at_stop
from spade.inference.protocol import SamplingParams

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
