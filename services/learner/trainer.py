"""The torch trainer: one GRPO update per call on a batch of ``TrainSample``.

``train_step`` is synchronous and pure in the sense that matters: given the same model, optimizer
state and batch it produces the same update (no queue, no disk). The ``Learner`` runs it with
``asyncio.to_thread``. Each micro-batch is packed into one row without padding
(``core.collate.pack``; the forward is ``logprobs.token_logprobs``). Single process on CPU or one
GPU; under ``torchrun`` the model is sharded with FSDP2 (``fully_shard``) and each rank trains on
its slice of the batch, the loss normaliser being the trained-token count of the whole batch over
all ranks.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from services.learner import logprobs
from services.learner.core.batching import (
    TrainSample,
    deal_by_prefixes,
    pack_by_prefixes,
    pack_by_tokens,
    pad_by_tokens,
)
from services.learner.core.collate import Collated, collate, pack
from services.learner.core.losses import LossInputs, PolicyLoss
from services.learner.distributed import World
from services.learner.logprobs import token_logprobs
from spade import training

__all__ = ["OptimConfig", "StepMetrics", "Trainer", "behaviour_logprobs", "shard_model", "token_logprobs"]


@dataclass(frozen=True)
class OptimConfig:
    """AdamW and step settings (defaults follow the paper's launch scripts)."""

    lr: float = 1e-6
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.98)
    grad_clip: float = 1.0
    micro_batch_tokens: int = 8192
    temperature: float = 1.0
    bf16: bool = True
    """bf16 autocast on a GPU (fp32 master weights, gradients and optimiser state)."""
    cpu_bf16: bool = False
    """bf16 autocast on the CPU as well (see ``LearnerSettings.cpu_bf16``)."""
    packed: bool = True
    """Pack each micro-batch into one row without padding (``False``: one right-padded row per
    sample, the budget then counting padded tokens; kept to measure what packing buys)."""
    share_prefixes: bool = True
    """Packed rows compute the tokens that samples begin with alike once (``core.collate.pack``), where
    the model runs segment attention (``logprobs.segment_attention_applies``); the logprobs are the
    same. ``False`` lays every sample out whole (to measure what sharing buys)."""


@dataclass(frozen=True)
class StepMetrics:
    """What one training step did (aggregated over micro-batches and ranks)."""

    loss: float
    clip_fraction: float
    kl: float
    logp_diff_mean: float
    logp_diff_max: float
    tis_mean: float
    tis_capped_fraction: float
    grad_norm: float
    samples: int
    tokens: int
    trained_tokens: int
    row_tokens: int
    """Tokens the forward passes computed: fewer than ``tokens`` where samples shared a prefix."""
    micro_batches: int
    step_time_s: float
    tokens_per_s: float

    def as_dict(self) -> dict[str, float]:
        """Flat metric names to values."""
        return {k: float(v) for k, v in asdict(self).items()}


def behaviour_logprobs(batch: Collated, own: torch.Tensor) -> torch.Tensor:
    """The logprobs the importance ratio compares against: the rollout's, or the learner's own for constrained tokens.

    A sample generated under a grammar (``TrainSample.constrained``) carries logprobs of the masked
    distribution, not of the policy; a truncated importance ratio against them would weight its tokens
    by how much the grammar moved the probabilities. Such tokens are treated as on-policy at the
    step: their behaviour logprobs are the learner's own at step start (``own``, detached), so
    their ratio is 1.
    """
    if batch.constrained is None:
        return batch.rollout_logprobs
    return torch.where(batch.constrained, own.detach().to(batch.rollout_logprobs.dtype), batch.rollout_logprobs)


def shard_model(model: nn.Module) -> None:
    """Shard a Hugging Face decoder with FSDP2: each decoder layer, then the root."""
    from torch.distributed.fsdp import fully_shard

    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise TypeError(f"cannot find the decoder layers of {type(model).__name__} (expected model.model.layers)")
    for layer in layers:
        fully_shard(layer)
    fully_shard(model)


def _adamw(params: list[nn.Parameter], optim: OptimConfig) -> torch.optim.AdamW:
    """AdamW, fused where torch has a fused kernel for the parameters (several times faster on CPU)."""
    return training.adamw(params, lr=optim.lr, betas=optim.betas, weight_decay=optim.weight_decay)


class Trainer:
    """GRPO updates of a causal LM.

    Args:
        model: The policy (already sharded when ``world.distributed``).
        loss: The policy loss (from ``build_loss``).
        optim: Optimiser and step settings.
        ref_model: Frozen reference for the KL term (required when the loss has ``kl_coef > 0``).
        world: The process group (single process by default).
        pad_id: Token used to pad micro-batches when ``optim.packed`` is off (its positions are masked out).
    """

    def __init__(
        self,
        model: nn.Module,
        loss: PolicyLoss,
        optim: OptimConfig = OptimConfig(),
        *,
        ref_model: nn.Module | None = None,
        world: World = World(),
        pad_id: int = 0,
    ) -> None:
        self.model = model
        self.loss = loss
        self.optim_config = optim
        self.ref_model = ref_model
        self.world = world
        self.pad_id = pad_id
        self.device = next(model.parameters()).device
        if ref_model is not None:
            ref_model.eval()
            ref_model.requires_grad_(False)
        self.optimizer = _adamw([p for p in model.parameters() if p.requires_grad], optim)
        self.share_prefixes = optim.packed and optim.share_prefixes and logprobs.segment_attention_applies(model)

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        on_cuda = self.device.type == "cuda"
        return training.autocast(self.device, self.optim_config.bf16 if on_cuda else self.optim_config.cpu_bf16)

    def _micro_batches(self, samples: Sequence[TrainSample]) -> list[list[TrainSample]]:
        budget = self.optim_config.micro_batch_tokens
        if self.share_prefixes:  # an env's plays in one micro-batch, to share their prompt there
            bins = pack_by_prefixes(samples, budget)
        elif self.optim_config.packed:
            bins = pack_by_tokens([len(s.token_ids) for s in samples], budget)
        else:
            bins = pad_by_tokens([len(s.token_ids) for s in samples], budget)
        return [[samples[i] for i in b] for b in bins]

    def _collate(self, samples: Sequence[TrainSample]) -> Collated:
        if self.optim_config.packed:
            return pack(samples, self.device, share_prefixes=self.share_prefixes)
        return collate(samples, self.pad_id, self.device)

    def _rank_slice(self, samples: Sequence[TrainSample]) -> list[TrainSample]:
        """This rank's part of the batch: with shared prefixes, whole prefix groups (``deal_by_prefixes``:
        an env's plays share their prompt on one rank, not on every rank); else every ``size``-th sample."""
        rank, size = self.world.rank, self.world.size
        if self.share_prefixes and size > 1:
            return [samples[i] for i in deal_by_prefixes(samples, size, self.optim_config.micro_batch_tokens)[rank]]
        return list(samples[rank::size])

    def _aligned_micro_batches(self, local: list[TrainSample], template: TrainSample) -> Iterator[list[TrainSample]]:
        """This rank's micro-batches, padded with inert ones so every rank runs as many passes.

        FSDP issues collectives inside forward/backward, so ranks must agree on the count.
        """
        mbs = self._micro_batches(local) if local else []
        (most,) = self.world.all_reduce_max([float(len(mbs))])
        inert = TrainSample(
            "inert", template.role, template.token_ids[:2], (0.0, 0.0), (False, False), template.weight_version
        )
        yield from mbs
        for _ in range(int(most) - len(mbs)):
            yield [inert]

    def train_step(self, samples: Sequence[TrainSample]) -> StepMetrics:
        """One optimiser update on ``samples`` (the whole batch; each rank takes its slice).

        The loss is the mean over every trained token of the batch, so micro-batching and sharding
        leave the gradient unchanged.

        Raises:
            ValueError: An empty batch, or a batch with no trained token.
        """
        if not samples:
            raise ValueError("train_step needs at least one sample; the learner skips empty steps")
        start = time.perf_counter()
        local = self._rank_slice(samples)
        local_trained = sum(s.trained_tokens for s in local)
        (total_trained,) = self.world.all_reduce_sum([float(local_trained)])
        if total_trained == 0:
            raise ValueError("the batch has no trained token (every loss_mask is false)")
        # FSDP/DDP average gradients over ranks; scale so the sum over ranks is the batch mean.
        normalizer = total_trained / self.world.size
        self.model.train()
        sums = {"loss": 0.0, "clipped": 0.0, "kl": 0.0, "diff": 0.0, "tis": 0.0, "capped": 0.0}
        diff_max = 0.0
        n_mb = 0
        row_tokens = 0
        for mb in self._aligned_micro_batches(local, samples[0]):
            n_mb += 1
            batch = self._collate(mb)
            row_tokens += batch.input_ids.numel()
            ref = None
            if self.ref_model is not None:
                with torch.no_grad(), self._autocast():
                    ref = token_logprobs(self.ref_model, batch, self.optim_config.temperature)
            with self._autocast():
                logp = token_logprobs(self.model, batch, self.optim_config.temperature)
            rollout = behaviour_logprobs(batch, logp)
            out = self.loss(
                LossInputs(
                    logprobs=logp,
                    old_logprobs=logp.detach(),
                    rollout_logprobs=rollout,
                    advantages=batch.advantages,
                    mask=batch.loss_mask,
                    ref_logprobs=ref,
                ),
                normalizer,
            )
            out.loss.backward()
            diff = (logp.detach() - rollout).abs() * batch.loss_mask
            sums["loss"] += float(out.loss.detach()) / self.world.size
            sums["clipped"] += out.clipped_sum
            sums["kl"] += out.kl_sum
            sums["diff"] += float(diff.sum())
            sums["tis"] += out.tis_sum
            sums["capped"] += out.tis_capped_sum
            diff_max = max(diff_max, float(diff.max()))
        grad_norm = self._clip_and_step()
        keys = list(sums)
        reduced = dict(zip(keys, self.world.all_reduce_sum([sums[k] for k in keys]), strict=True))
        (diff_max,) = self.world.all_reduce_max([diff_max])
        tokens, computed = self.world.all_reduce_sum([float(sum(len(s.token_ids) for s in local)), float(row_tokens)])
        elapsed = time.perf_counter() - start
        return StepMetrics(
            loss=reduced["loss"],
            clip_fraction=reduced["clipped"] / total_trained,
            kl=reduced["kl"] / total_trained,
            logp_diff_mean=reduced["diff"] / total_trained,
            logp_diff_max=diff_max,
            tis_mean=reduced["tis"] / total_trained,
            tis_capped_fraction=reduced["capped"] / total_trained,
            grad_norm=grad_norm,
            samples=len(samples),
            tokens=int(tokens),
            trained_tokens=int(total_trained),
            row_tokens=int(computed),
            micro_batches=n_mb,
            step_time_s=elapsed,
            tokens_per_s=tokens / elapsed if elapsed > 0 else 0.0,
        )

    def _clip_and_step(self) -> float:
        params = [p for p in self.model.parameters() if p.requires_grad]
        norm = torch.nn.utils.clip_grad_norm_(params, self.optim_config.grad_clip)
        if hasattr(norm, "full_tensor"):  # DTensor under FSDP2
            norm = norm.full_tensor()
        value = float(norm)
        if math.isfinite(value):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return value

    @torch.no_grad()
    def batch_logprobs(self, samples: Sequence[TrainSample]) -> list[torch.Tensor]:
        """Current logprobs of each sample's tokens (``(len−1,)`` each), in eval mode."""
        self.model.eval()
        out: list[torch.Tensor] = []
        for s in samples:
            batch = pack([s], self.device)
            with self._autocast():
                out.append(token_logprobs(self.model, batch, self.optim_config.temperature)[0].cpu())
        return out

    @torch.no_grad()
    def batch_loss(self, samples: Sequence[TrainSample], old_logprobs: Sequence[torch.Tensor]) -> float:
        """The loss of the batch against fixed ``old_logprobs`` (to check that a step lowered it)."""
        self.model.eval()
        total = float(sum(s.trained_tokens for s in samples))
        loss = 0.0
        for s, old in zip(samples, old_logprobs, strict=True):
            batch = pack([s], self.device)
            with self._autocast():
                logp = token_logprobs(self.model, batch, self.optim_config.temperature)
            ref = None
            if self.ref_model is not None:
                ref = token_logprobs(self.ref_model, batch, self.optim_config.temperature)
            out = self.loss(
                LossInputs(
                    logp,
                    old.unsqueeze(0).to(self.device),
                    behaviour_logprobs(batch, old.unsqueeze(0).to(self.device)),
                    batch.advantages,
                    batch.loss_mask,
                    ref,
                ),
                total,
            )
            loss += float(out.loss)
        return loss
