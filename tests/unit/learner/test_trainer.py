"""The trainer: real updates on a tiny Llama."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from services.learner.core.losses import GrpoLossConfig, build_loss
from services.learner.trainer import OptimConfig, Trainer

from .conftest import random_batch, tiny_llama

pytestmark = pytest.mark.model


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_one_step_changes_every_parameter_and_lowers_the_loss_on_that_batch():
    model = tiny_llama(seed=0)
    trainer = Trainer(model, build_loss(GrpoLossConfig()), OptimConfig(lr=1e-3, weight_decay=0.0))
    batch = random_batch(n=8, seed=3)
    old = trainer.batch_logprobs(batch)
    before = trainer.batch_loss(batch, old)
    params = _params(model)
    metrics = trainer.train_step(batch)
    after = trainer.batch_loss(batch, old)
    assert after < before
    unchanged = [n for n, p in model.named_parameters() if torch.equal(p, params[n])]
    assert unchanged == []
    assert metrics.loss == pytest.approx(before, abs=1e-5)  # same batch, same weights, ratio 1
    assert metrics.grad_norm > 0 and metrics.trained_tokens == sum(s.trained_tokens for s in batch)
    assert metrics.clip_fraction == 0.0  # one update per batch: the ratio is exactly 1
    assert metrics.logp_diff_max >= metrics.logp_diff_mean > 0
    assert 0 < metrics.tis_mean <= 2.0


def test_micro_batching_does_not_change_the_update():
    batch = random_batch(n=7, seed=4)
    results = []
    for budget in (10_000, 24):
        model = tiny_llama(seed=1)
        trainer = Trainer(
            model, build_loss(GrpoLossConfig(kl_coef=0.0)), OptimConfig(lr=1e-3, micro_batch_tokens=budget)
        )
        m = trainer.train_step(batch)
        # Adam's first moment is 0.1 × the (clipped) gradient: compare gradients, not the
        # sign-like first Adam step, which amplifies float rounding of near-zero gradients.
        grads = [trainer.optimizer.state[p]["exp_avg"].clone() for p in model.parameters()]
        results.append((m, grads))
    (m_one, g_one), (m_many, g_many) = results
    assert m_many.micro_batches > m_one.micro_batches == 1
    assert m_one.loss == pytest.approx(m_many.loss, abs=1e-6)
    assert m_one.grad_norm == pytest.approx(m_many.grad_norm, rel=1e-5)
    for a, b in zip(g_one, g_many, strict=True):
        assert torch.allclose(a, b, atol=1e-8, rtol=1e-4)


def test_kl_to_a_frozen_reference_is_reported_and_reference_stays_frozen():
    model, ref = tiny_llama(seed=0), tiny_llama(seed=9)
    ref_params = _params(ref)
    trainer = Trainer(model, build_loss(GrpoLossConfig(kl_coef=0.1)), OptimConfig(lr=1e-3), ref_model=ref)
    m = trainer.train_step(random_batch(seed=5))
    assert m.kl > 0
    assert all(torch.equal(p, ref_params[n]) for n, p in ref.named_parameters())


def test_gradient_clipping_bounds_the_update():
    batch = [replace(s, advantage=s.advantage * 1e4) for s in random_batch(seed=6)]
    model = tiny_llama(seed=2)
    trainer = Trainer(model, build_loss(GrpoLossConfig()), OptimConfig(grad_clip=0.5, lr=1e-3))
    m = trainer.train_step(batch)
    assert m.grad_norm > 0.5  # reported before clipping
    # Adam's first step moves each parameter by ~lr whatever the scale; check the clipped grads instead.
    for group in trainer.optimizer.param_groups:
        for p in group["params"]:
            assert trainer.optimizer.state[p]["exp_avg"].abs().max() <= 0.5 * 0.1 + 1e-6


def test_empty_or_untrainable_batches_are_rejected():
    trainer = Trainer(tiny_llama(), build_loss(GrpoLossConfig()))
    with pytest.raises(ValueError, match="at least one sample"):
        trainer.train_step([])
    untrained = [replace(s, loss_mask=(False,) * len(s.token_ids)) for s in random_batch(n=2)]
    with pytest.raises(ValueError, match="no trained token"):
        trainer.train_step(untrained)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_chunked_logprob_head_equals_full_logits_values_and_gradients(temperature):
    from services.learner.core.collate import collate
    from services.learner.trainer import token_logprobs

    batch = collate(random_batch(n=4, seed=8))
    results = []
    for kwargs in ({"fused": False}, {"logits_budget": 64 * 3}):  # 3 trained positions per chunk
        model = tiny_llama(seed=4)
        logp = token_logprobs(model, batch, temperature, **kwargs)
        (logp * batch.loss_mask).sum().backward()
        results.append((logp.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
        assert model.lm_head.forward.__self__ is model.lm_head  # the patch is undone
    (full, g_full), (chunked, g_chunked) = results
    assert torch.allclose(full * batch.loss_mask, chunked, atol=1e-6)  # untrained positions hold 0
    assert len(g_full) == len(g_chunked)
    for a, b in zip(g_full, g_chunked, strict=True):
        assert torch.allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("packed", [True, False])
def test_constrained_samples_are_on_policy_at_the_step(packed):
    """A sample generated under a grammar carries logprobs of the masked distribution: its importance
    ratio must not be taken against them. Its update equals that of the same sample whose rollout
    logprobs are the learner's own at step start (TIS weight 1), whatever logprobs it carries."""
    batch = random_batch(n=4, seed=5)
    far = [replace(s, rollout_logprobs=tuple(-20.0 if m else 0.0 for m in s.loss_mask)) for s in batch]

    def step(samples):
        model = tiny_llama(seed=2)
        trainer = Trainer(model, build_loss(GrpoLossConfig()), OptimConfig(lr=1e-3, packed=packed))
        own = trainer.batch_logprobs(samples)
        m = trainer.train_step(samples)
        return m, [trainer.optimizer.state[p]["exp_avg"].clone() for p in model.parameters()], own

    _, _, own = step(batch)
    exact = []
    for s, lp in zip(batch, own, strict=True):
        mine = (float(v) if trained else 0.0 for v, trained in zip(lp, s.loss_mask[1:], strict=True))
        exact.append(replace(s, rollout_logprobs=(0.0, *mine)))
    m_exact, g_exact, _ = step(exact)
    m_constrained, g_constrained, _ = step([replace(s, constrained=True) for s in far])
    m_far, _, _ = step(far)
    assert m_exact.tis_mean == pytest.approx(1.0, abs=1e-4) and m_constrained.tis_mean == 1.0
    assert m_constrained.logp_diff_max == 0.0  # measured against the learner's own logprobs
    assert m_constrained.loss == pytest.approx(m_exact.loss, abs=1e-6)
    for a, b in zip(g_constrained, g_exact, strict=True):
        assert torch.allclose(a, b, atol=1e-7, rtol=1e-3)
    assert m_constrained.grad_norm == pytest.approx(m_exact.grad_norm, rel=1e-4)
    # Unconstrained, the same far-off logprobs cap every token's TIS weight at 2: twice the gradient.
    assert m_far.tis_capped_fraction == 1.0
    assert m_far.grad_norm == pytest.approx(2 * m_exact.grad_norm, rel=1e-3)


def test_cpu_bf16_multiplies_in_bf16_keeps_fp32_state_and_learns():
    """``cpu_bf16``: the products run in bf16 (what makes a CPU step ~1.8x as fast), the weights,
    gradients and Adam's moments stay fp32, and the step still lowers the batch's loss."""
    batch = random_batch(n=6, seed=11)
    seen: dict[bool, set[torch.dtype]] = {}
    logp: dict[bool, list[torch.Tensor]] = {}
    for cpu_bf16 in (False, True):
        model = tiny_llama(seed=3)
        trainer = Trainer(model, build_loss(GrpoLossConfig()), OptimConfig(lr=1e-3, cpu_bf16=cpu_bf16))
        dtypes: set[torch.dtype] = set()
        hook = model.model.layers[0].mlp.down_proj.register_forward_hook(
            lambda m, i, o, seen_here=dtypes: seen_here.add(o.dtype)
        )
        old = trainer.batch_logprobs(batch)
        before = trainer.batch_loss(batch, old)
        trainer.train_step(batch)
        hook.remove()
        assert trainer.batch_loss(batch, old) < before
        assert {p.dtype for p in model.parameters()} == {torch.float32}
        assert {p.grad is None for p in model.parameters()} == {True}  # zeroed after the step
        moments = [s["exp_avg"].dtype for s in trainer.optimizer.state.values()]
        assert moments and set(moments) == {torch.float32}
        seen[cpu_bf16], logp[cpu_bf16] = dtypes, old
    assert seen == {False: {torch.float32}, True: {torch.bfloat16}}
    diff = max(float((a - b).abs().max()) for a, b in zip(logp[False], logp[True], strict=True))
    assert 0 < diff < 0.5  # bf16's rounding, not another model
