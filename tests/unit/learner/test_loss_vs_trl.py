"""Our GRPO loss against TRL's ``GRPOTrainer._compute_loss`` on the same batch and model.

The formulations coincide for TRL's ``bnpo`` (token-level mean over every unmasked token of the
batch) and ``cispo`` losses with token-level truncated IS (``token_truncate``) and the k3 KL. TRL is
driven through its own ``_compute_loss`` and ``_get_per_token_logps_and_entropies`` (its fused,
tiled LM head computes the logprobs, independently of ours); only the trainer object around those
methods is a namespace holding the attributes they read. Multi-turn loss masks go in as TRL's
``tool_mask``.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import types
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from trl.trainer.grpo_trainer import GRPOTrainer
from trl.trainer.utils import add_fused_lm_head

from services.learner.core.collate import collate
from services.learner.core.losses import (
    CispoLossConfig,
    GrpoLossConfig,
    LossConfigAdapter,
    LossInputs,
    build_loss,
    low_var_kl,
)
from services.learner.trainer import token_logprobs

from .conftest import random_batch, tiny_llama


def _trl_self(model, loss_type: str, beta: float, eps_low: float, eps_high: float, temperature: float):
    accel = SimpleNamespace(
        autocast=contextlib.nullcontext,
        gather=lambda x: x,
        gather_for_metrics=lambda x: x,
        reduce=lambda x, reduction="sum": x,
        num_processes=1,
        is_main_process=True,
    )
    fake = SimpleNamespace(
        model=model,
        accelerator=accel,
        loss_type=loss_type,
        beta=beta,
        epsilon_low=eps_low,
        epsilon_high=eps_high,
        importance_sampling_level="token",
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        use_vllm=True,
        vllm_importance_sampling_correction=True,
        aux_loss_enabled=False,
        _entropy_bonus_enabled=False,
        current_gradient_accumulation_steps=1,
        temperature=temperature,
        args=SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
    )
    fake._get_per_token_logps_and_entropies = functools.partial(GRPOTrainer._get_per_token_logps_and_entropies, fake)
    return fake


def _trl_inputs(fake, batch, ref_model, tis_cap: float):
    """TRL's inputs, built the way ``_generate_and_score_completions`` builds them."""
    ids, attn = batch.input_ids, batch.attention_mask
    prompt_ids, completion_ids = ids[:, :1], ids[:, 1:]
    prompt_mask, completion_mask = attn[:, :1], attn[:, 1:]
    logits_to_keep = completion_ids.size(1)
    tool_mask = batch.loss_mask.long()
    with torch.no_grad():
        old, _, _ = fake._get_per_token_logps_and_entropies(fake.model, ids, attn, logits_to_keep)
        ref = None
        if ref_model is not None:
            ref, _, _ = fake._get_per_token_logps_and_entropies(ref_model, ids, attn, logits_to_keep)
    mask = completion_mask * tool_mask
    diff = torch.nan_to_num((old - batch.rollout_logprobs) * mask, nan=0.0)
    is_ratio = torch.clamp(torch.exp(diff), min=0.0, max=tis_cap)
    inputs = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "tool_mask": tool_mask,
        "advantages": batch.advantages,
        "old_per_token_logps": old,
        "importance_sampling_ratio": is_ratio,
        "num_items_in_batch": mask.sum(),
    }
    if ref is not None:
        inputs["ref_per_token_logps"] = ref
    return inputs


def _ours(model, ref_model, batch, config, temperature):
    logp = token_logprobs(model, batch, temperature)
    ref = token_logprobs(ref_model, batch, temperature).detach() if ref_model is not None else None
    loss = build_loss(config)
    out = loss(
        LossInputs(logp, logp.detach(), batch.rollout_logprobs, batch.advantages, batch.loss_mask, ref),
        float(batch.loss_mask.sum()),
    )
    return out.loss


CASES = [
    ("bnpo", GrpoLossConfig(), 1.0),
    ("bnpo", GrpoLossConfig(kl_coef=0.05, eps_low=0.1, eps_high=0.3), 0.6),
    ("bnpo", GrpoLossConfig(tis_cap=1.5, kl_coef=0.005), 1.0),
    ("cispo", CispoLossConfig(kl_coef=0.01), 0.7),
]


@pytest.mark.model
@pytest.mark.parametrize(("trl_type", "config", "temperature"), CASES)
def test_loss_and_gradients_match_trl(trl_type, config, temperature):
    torch.use_deterministic_algorithms(False)
    ours_model = tiny_llama(seed=3)
    # Move the policy away from the reference so the KL term is not zero.
    ref_model = tiny_llama(seed=4) if config.kl_coef > 0 else None
    trl_model = copy.deepcopy(ours_model)
    trl_ref = copy.deepcopy(ref_model) if ref_model is not None else None
    for m in (trl_model, trl_ref):
        if m is not None:
            add_fused_lm_head(m, temperature=temperature, outputs=("log_probs", "entropy"))
    samples = random_batch(n=5, seed=11)
    batch = collate(samples)

    ours = _ours(ours_model, ref_model, batch, config, temperature)
    ours.backward()

    eps_low = getattr(config, "eps_low", 0.2)
    fake = _trl_self(trl_model, trl_type, config.kl_coef, eps_low, config.eps_high, temperature)
    trl_model.train()
    trl_loss = GRPOTrainer._compute_loss(fake, trl_model, _trl_inputs(fake, batch, trl_ref, config.tis_cap))
    trl_loss.backward()

    assert float(ours.detach()) == pytest.approx(float(trl_loss.detach()), abs=1e-5)
    assert abs(float(ours.detach())) > 1e-3  # a vacuous match on zero would prove nothing
    for (name, p), q in zip(ours_model.named_parameters(), trl_model.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        assert torch.allclose(p.grad, q.grad, atol=1e-5, rtol=1e-4), name


def test_clipping_engages_with_asymmetric_bounds():
    loss = build_loss(GrpoLossConfig(tis=False))
    old = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[0.5, 0.85, 1.2, 1.4]]))  # ratios 0.5, 0.85, 1.2, 1.4
    mask = torch.ones(1, 4)
    pos = loss(LossInputs(logp, old, old, torch.tensor([1.0]), mask), 4.0)
    # A>0: min(r, clip(r, .8, 1.28)) -> 0.5, 0.85, 1.2, 1.28
    assert float(pos.loss) == pytest.approx(-(0.5 + 0.85 + 1.2 + 1.28) / 4)
    assert pos.clipped_sum == 1.0
    neg = loss(LossInputs(logp, old, old, torch.tensor([-1.0]), mask), 4.0)
    # A<0: -min(-r, -clip(r)) = max(r, clip(r)) -> 0.8, 0.85, 1.2, 1.4
    assert float(neg.loss) == pytest.approx((0.8 + 0.85 + 1.2 + 1.4) / 4)
    assert neg.clipped_sum == 1.0


def test_tis_caps_the_ratio_and_masked_tokens_do_not_count():
    loss = build_loss(GrpoLossConfig(tis_cap=2.0))
    logp = torch.zeros(1, 3, requires_grad=True)
    rollout = torch.tensor([[-3.0, 0.0, -0.1]])  # exp(3) capped to 2; exp(0.1) kept
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    out = loss(LossInputs(logp, logp.detach(), rollout, torch.tensor([1.0]), mask), 2.0)
    assert float(out.loss.detach()) == pytest.approx(-(2.0 + torch.exp(torch.tensor(0.1)).item()) / 2)
    assert out.tis_capped_sum == 1.0
    out.loss.backward()
    assert logp.grad is not None and logp.grad[0, 1] == 0.0


def test_kl_is_k3_and_nonnegative():
    logp = torch.tensor([-1.0, -2.0, -0.5])
    ref = torch.tensor([-1.0, -1.0, -3.0])
    kl = low_var_kl(logp, ref)
    d = ref - logp
    assert torch.allclose(kl, torch.exp(d) - d - 1)
    assert kl[0] == 0 and bool((kl >= 0).all())
    loss = build_loss(GrpoLossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="ref_logprobs"):
        loss(LossInputs(logp[None], logp[None], logp[None], torch.tensor([1.0]), torch.ones(1, 3)), 3.0)


def test_loss_registry_is_chosen_by_the_type_tag():
    cfg = LossConfigAdapter.validate_python({"type": "cispo", "eps_high": 4.0})
    assert isinstance(cfg, CispoLossConfig)
    assert type(build_loss(cfg)).__name__ == "CispoLoss"
    assert type(build_loss(LossConfigAdapter.validate_python({"type": "grpo"}))).__name__ == "GrpoLoss"
    with pytest.raises(ValueError, match="type"):
        LossConfigAdapter.validate_python({"type": "ppo-classic"})


def _rms_norm_in_input_dtype(self, x: torch.Tensor) -> torch.Tensor:
    # Llama's RMSNorm computes in float32 whatever the input dtype; in float64 (needed for finite
    # differences) the same maths must stay in float64.
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def _float64(model):
    model = model.double()
    for mod in model.modules():
        if isinstance(mod, LlamaRMSNorm):
            mod.forward = types.MethodType(_rms_norm_in_input_dtype, mod)  # type: ignore[method-assign]
    return model


@pytest.mark.model
def test_gradient_check_on_a_tiny_model():
    """Autograd's gradient of the whole pipeline (model → logprobs → loss) against finite differences."""
    model = _float64(tiny_llama(seed=5))
    ref = _float64(tiny_llama(seed=6))
    batch = collate(random_batch(n=3, seed=2, max_len=10))
    batch.rollout_logprobs = batch.rollout_logprobs.double()
    batch.advantages = batch.advantages.double()
    batch.loss_mask = batch.loss_mask.double()
    loss = build_loss(GrpoLossConfig(kl_coef=0.1))
    with torch.no_grad():
        old = token_logprobs(model, batch) + 0.05 * torch.randn(batch.targets.shape, dtype=torch.float64)

    def f() -> torch.Tensor:
        logp = token_logprobs(model, batch)
        r = token_logprobs(ref, batch).detach()
        return loss(LossInputs(logp, old, batch.rollout_logprobs, batch.advantages, batch.loss_mask, r), 7.0).loss

    model.zero_grad()
    f().backward()
    torch.manual_seed(0)
    checked = 0
    nonzero = 0
    for name, p in model.named_parameters():
        grad = p.grad
        assert grad is not None, name
        for _ in range(2):
            idx = tuple(int(torch.randint(0, s, ())) for s in p.shape)
            orig = float(p.data[idx])
            h = 1e-6
            with torch.no_grad():
                p.data[idx] = orig + h
                up = float(f())
                p.data[idx] = orig - h
                down = float(f())
                p.data[idx] = orig
            numeric = (up - down) / (2 * h)
            assert float(grad[idx]) == pytest.approx(numeric, abs=1e-7, rel=1e-4), name
            checked += 1
            nonzero += abs(numeric) > 1e-6
    assert nonzero >= checked // 2
    assert checked >= 2 * len(list(model.parameters()))
