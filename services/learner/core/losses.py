"""Policy-gradient losses, chosen by a discriminated-union config from a registry.

Every loss is token-level: per-token terms are summed over the unmasked (model-generated) tokens and
divided by ``normalizer``, the number of unmasked tokens of the *whole* step batch, so micro-batches
(and ranks) add up to the mean over all unmasked tokens of the batch.

Shared conventions (all tensors ``(B, T)`` unless noted; ``mask`` is 1 on trained tokens):

- ``logprobs``: the training policy's logprobs (with grad);
- ``old_logprobs``: the same policy before this update (detached); the PPO ratio is
  ``exp(logprobs − old_logprobs)``;
- ``rollout_logprobs``: what the inference engine reported when sampling; truncated importance
  sampling (TIS) multiplies each token's policy term by ``min(exp(old − rollout), tis_cap)``
  (detached), correcting for the engine/trainer mismatch and for stale weights;
- ``ref_logprobs``: a frozen reference policy, for the optional low-variance KL
  ``exp(ref − logp) − (ref − logp) − 1`` (Schulman's k3), added with weight ``kl_coef``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Protocol

import torch
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter


class _LossConfigBase(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    kl_coef: float = Field(
        default=0.0, ge=0.0, le=10.0, description="Weight of the low-variance KL to the frozen reference (0 = off)."
    )
    tis: bool = Field(default=True, description="Truncated importance sampling against the rollout logprobs.")
    tis_cap: float = Field(default=2.0, gt=0.0, le=100.0, description="Upper cap of the TIS ratio.")
    tis_floor: float = Field(default=0.0, ge=0.0, le=1.0, description="Lower clamp of the TIS ratio.")


class GrpoLossConfig(_LossConfigBase):
    """The clipped surrogate with clip-higher (DAPO's asymmetric clip), token-level mean."""

    type: Literal["grpo"] = "grpo"
    eps_low: float = Field(default=0.2, gt=0.0, lt=1.0, description="Lower clip: ratio floor is 1 − eps_low.")
    eps_high: float = Field(default=0.28, gt=0.0, le=10.0, description="Upper clip: ratio ceiling is 1 + eps_high.")


class CispoLossConfig(_LossConfigBase):
    """CISPO: REINFORCE on logprobs weighted by the detached, upper-clipped ratio (no token is zeroed)."""

    type: Literal["cispo"] = "cispo"
    eps_high: float = Field(default=5.0, gt=0.0, le=100.0, description="Ceiling of the detached ratio weight.")


LossConfig = Annotated[GrpoLossConfig | CispoLossConfig, Field(discriminator="type")]
"""A loss variant tagged by ``type`` (``grpo`` or ``cispo``)."""

LossConfigAdapter: TypeAdapter[GrpoLossConfig | CispoLossConfig] = TypeAdapter(LossConfig)


@dataclass
class LossInputs:
    """One micro-batch's tensors (see the module docstring).

    ``advantages`` is per sequence ``(B,)`` (padded rows) or per token ``(B, T)`` (packed rows,
    where one row holds several sequences).
    """

    logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    rollout_logprobs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    ref_logprobs: torch.Tensor | None = None


@dataclass
class LossOutput:
    """The micro-batch's loss (already divided by the batch normalizer) and metric sums.

    The ``*_sum`` fields are sums over unmasked tokens (detached floats), so they aggregate exactly
    across micro-batches and ranks; divide by the token count for means.
    """

    loss: torch.Tensor
    clipped_sum: float
    kl_sum: float
    tis_sum: float
    tis_capped_sum: float


class PolicyLoss(Protocol):
    """A loss variant: ``__call__(inputs, normalizer) -> LossOutput``."""

    def __call__(self, inputs: LossInputs, normalizer: float) -> LossOutput: ...


def low_var_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(policy ‖ ref): ``exp(ref − logp) − (ref − logp) − 1`` (>= 0)."""
    delta = ref_logprobs - logprobs
    return torch.exp(delta) - delta - 1.0


def _token_advantages(inputs: LossInputs) -> torch.Tensor:
    adv = inputs.advantages
    return adv if adv.dim() == 2 else adv.unsqueeze(1)


def _tis_weights(cfg: _LossConfigBase, inputs: LossInputs) -> torch.Tensor:
    if not cfg.tis:
        return torch.ones_like(inputs.old_logprobs)
    # Masked positions carry rollout logprob 0 by convention; zero their difference so no inf leaks.
    diff = (inputs.old_logprobs - inputs.rollout_logprobs) * inputs.mask
    return torch.clamp(torch.exp(diff), min=cfg.tis_floor, max=cfg.tis_cap).detach()


def _finish(
    cfg: _LossConfigBase,
    inputs: LossInputs,
    policy_term: torch.Tensor,
    clipped: torch.Tensor,
    tis: torch.Tensor,
    normalizer: float,
) -> LossOutput:
    mask = inputs.mask
    per_token = policy_term * tis
    kl_sum = 0.0
    if cfg.kl_coef > 0.0:
        if inputs.ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs from the frozen reference; none were given")
        kl = low_var_kl(inputs.logprobs, inputs.ref_logprobs)
        per_token = per_token + cfg.kl_coef * kl
        kl_sum = float((kl.detach() * mask).sum())
    loss = (per_token * mask).sum() / max(normalizer, 1.0)
    capped = ((tis >= cfg.tis_cap) & (mask > 0)).float() if cfg.tis else torch.zeros_like(mask)
    return LossOutput(
        loss=loss,
        clipped_sum=float((clipped.float() * mask).sum()),
        kl_sum=kl_sum,
        tis_sum=float((tis * mask).sum()),
        tis_capped_sum=float(capped.sum()),
    )


class GrpoLoss:
    """``−min(r·A, clip(r, 1−ε_low, 1+ε_high)·A) · tis (+ β·KL)``, token-level mean."""

    def __init__(self, config: GrpoLossConfig) -> None:
        self.config = config

    def __call__(self, inputs: LossInputs, normalizer: float) -> LossOutput:
        cfg = self.config
        adv = _token_advantages(inputs)
        ratio = torch.exp(inputs.logprobs - inputs.old_logprobs)
        clipped_ratio = torch.clamp(ratio, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
        policy_term = -torch.min(ratio * adv, clipped_ratio * adv)
        clipped = ((ratio < 1.0 - cfg.eps_low) & (adv < 0)) | ((ratio > 1.0 + cfg.eps_high) & (adv > 0))
        return _finish(cfg, inputs, policy_term, clipped, _tis_weights(cfg, inputs), normalizer)


class CispoLoss:
    """``−sg(min(r, ε_high))·A·logp · tis (+ β·KL)``, token-level mean."""

    def __init__(self, config: CispoLossConfig) -> None:
        self.config = config

    def __call__(self, inputs: LossInputs, normalizer: float) -> LossOutput:
        cfg = self.config
        adv = _token_advantages(inputs)
        ratio = torch.exp(inputs.logprobs - inputs.old_logprobs)
        weight = torch.clamp(ratio, max=cfg.eps_high).detach()
        policy_term = -weight * adv * inputs.logprobs
        clipped = (ratio > cfg.eps_high) & (adv > 0)
        return _finish(cfg, inputs, policy_term, clipped, _tis_weights(cfg, inputs), normalizer)


_REGISTRY: dict[type[BaseModel], Callable[[Any], PolicyLoss]] = {
    GrpoLossConfig: GrpoLoss,
    CispoLossConfig: CispoLoss,
}


def build_loss(config: GrpoLossConfig | CispoLossConfig) -> PolicyLoss:
    """The loss a config selects (the one place the variant is chosen)."""
    return _REGISTRY[type(config)](config)
