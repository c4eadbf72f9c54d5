"""Training samples, advantages for both roles, and micro-batching by token budget.

A ``TrainSample`` is one sequence the policy is trained on: the agent's whole multi-turn play
(prompt, every model turn, every observation) or the designer's prompt plus its output. Only tokens
with ``loss_mask`` true train; ``rollout_logprobs[i]`` is the inference engine's logprob of
``token_ids[i]`` (0 where the mask is false).
"""

from __future__ import annotations

import enum
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from services.learner.core.rewards import center_by_key, group_zscores
from services.learner.core.window import ScoredAttempt, ScoreOutcome


class Role(enum.Enum):
    """Which role produced a sample; advantages are normalised per role."""

    AGENT = "agent"
    DESIGNER = "designer"


class BatchError(ValueError):
    """A sample that cannot be trained on (the message names the rule and the value)."""


@dataclass(frozen=True)
class TrainSample:
    """One trainable sequence with its advantage."""

    sample_id: str
    role: Role
    token_ids: tuple[int, ...]
    rollout_logprobs: tuple[float, ...]
    loss_mask: tuple[bool, ...]
    weight_version: int
    advantage: float = 0.0

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if n < 2 or len(self.rollout_logprobs) != n or len(self.loss_mask) != n:
            raise BatchError(
                f"sample {self.sample_id}: token_ids ({n}), rollout_logprobs ({len(self.rollout_logprobs)}) "
                "and loss_mask ({}) must have one entry per token and at least 2 tokens".format(len(self.loss_mask))
            )
        if self.loss_mask[0]:
            raise BatchError(
                f"sample {self.sample_id}: the first token cannot be trained (nothing predicts it); "
                "loss_mask[0] must be false"
            )
        if not math.isfinite(self.advantage):
            raise BatchError(f"sample {self.sample_id}: advantage must be finite, got {self.advantage}")

    @property
    def trained_tokens(self) -> int:
        """Number of tokens with a loss."""
        return sum(self.loss_mask)


@dataclass(frozen=True)
class AgentPlaySample:
    """An agent play with its return, before advantages (a domain copy of the wire sample)."""

    sample: TrainSample
    group_key: str
    episode_return: float


def agent_advantages(plays: Sequence[AgentPlaySample], eps: float = 1e-6) -> tuple[list[TrainSample], int, int]:
    """Z-score returns within each group (one env at one weight version); drop zero-variance groups.

    Returns:
        ``(samples with advantages, groups kept, groups dropped for zero variance)``.
    """
    groups: dict[str, list[AgentPlaySample]] = defaultdict(list)
    for p in plays:
        groups[p.group_key].append(p)
    out: list[TrainSample] = []
    dropped = 0
    for members in groups.values():
        z = group_zscores([m.episode_return for m in members], eps)
        if z is None:
            dropped += 1
            continue
        out.extend(replace(m.sample, advantage=a) for m, a in zip(members, z, strict=True))
    return out, len(groups) - dropped, dropped


def designer_sample(attempt: ScoredAttempt) -> TrainSample:
    """The designer's trained sequence: prompt (untrained) then its output (trained)."""
    a = attempt.attempt
    if not a.output_ids:
        raise BatchError(f"designer sample {a.sample_id} has no output tokens to train")
    if len(a.output_logprobs) != len(a.output_ids):
        raise BatchError(
            f"designer sample {a.sample_id}: {len(a.output_ids)} output tokens but "
            f"{len(a.output_logprobs)} logprobs; the designer must send one logprob per output token"
        )
    prompt = a.prompt_ids or (0,)
    return TrainSample(
        sample_id=a.sample_id,
        role=Role.DESIGNER,
        token_ids=tuple(prompt) + tuple(a.output_ids),
        rollout_logprobs=(0.0,) * len(prompt) + tuple(a.output_logprobs),
        loss_mask=(False,) * len(prompt) + (True,) * len(a.output_ids),
        weight_version=a.weight_version,
    )


def designer_advantages(scored: Sequence[ScoredAttempt], eps: float = 1e-9) -> tuple[list[TrainSample], int, int]:
    """Blend minus the mean blend of the same skill within the same regeneration batch.

    Unscorable attempts are skipped (the caller counts them). A (batch, skill) group whose
    centred rewards are all zero (a single attempt, or equal blends) carries no signal and is dropped.

    Returns:
        ``(samples with advantages, groups kept, groups dropped for zero variance)``.
    """
    usable = [s for s in scored if s.outcome is not ScoreOutcome.UNSCORABLE and s.components is not None]
    keys = [f"{s.attempt.batch_id}\x00{s.attempt.skill}" for s in usable]
    blends = [s.components.blend for s in usable if s.components is not None]
    centred = center_by_key(blends, keys)
    by_key: dict[str, list[tuple[ScoredAttempt, float]]] = defaultdict(list)
    for s, k, c in zip(usable, keys, centred, strict=True):
        by_key[k].append((s, c))
    out: list[TrainSample] = []
    dropped = 0
    for members in by_key.values():
        if all(abs(c) < eps for _, c in members):
            dropped += 1
            continue
        out.extend(replace(designer_sample(s), advantage=c) for s, c in members)
    return out, len(by_key) - dropped, dropped


def normalize_per_role(samples: Sequence[TrainSample], eps: float = 1e-6) -> list[TrainSample]:
    """Divide each role's advantages by that role's std in the batch (means are left as they are).

    Agent z-scores and centred designer blends live on different scales (the reference code ran
    designer advantages ×32–50 hotter); scaling each role to unit std gives both roles comparable
    weight in the shared update. A role whose std is below ``eps`` is left unchanged.
    """
    scale: dict[Role, float] = {}
    for role in Role:
        values = [s.advantage for s in samples if s.role is role]
        if len(values) < 2:
            continue
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
        if std >= eps:
            scale[role] = std
    return [replace(s, advantage=s.advantage / scale[s.role]) if s.role in scale else s for s in samples]


def pack_by_tokens(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Group sample indices into micro-batches whose padded size (count × longest) fits ``budget``.

    Longest first, first fit. A sample longer than the budget gets a micro-batch of its own (it
    cannot be split without changing the loss).

    >>> pack_by_tokens([4, 4, 8, 2], 8)
    [[2], [0, 1], [3]]
    """
    if budget < 1:
        raise BatchError(f"micro-batch token budget must be >= 1, got {budget}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    widths: list[int] = []
    for i in order:
        for b, members in enumerate(bins):
            width = max(widths[b], lengths[i])
            if width * (len(members) + 1) <= budget:
                members.append(i)
                widths[b] = width
                break
        else:
            bins.append([i])
            widths.append(lengths[i])
    return bins


@dataclass
class Collated:
    """Right-padded tensors of one micro-batch, aligned to next-token prediction.

    ``input_ids``/``attention_mask`` are ``(B, T)``; the target tensors are ``(B, T−1)``: position
    ``t`` holds the data of token ``t+1`` (predicted from the logits at ``t``).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    targets: torch.Tensor
    loss_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    advantages: torch.Tensor


def collate(samples: Sequence[TrainSample], pad_id: int = 0, device: torch.device | str = "cpu") -> Collated:
    """Pad samples into one micro-batch (see ``Collated``)."""
    width = max(len(s.token_ids) for s in samples)
    b = len(samples)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    attn = torch.zeros((b, width), dtype=torch.long)
    mask = torch.zeros((b, width), dtype=torch.float32)
    lps = torch.zeros((b, width), dtype=torch.float32)
    for row, s in enumerate(samples):
        n = len(s.token_ids)
        ids[row, :n] = torch.tensor(s.token_ids, dtype=torch.long)
        attn[row, :n] = 1
        mask[row, :n] = torch.tensor(s.loss_mask, dtype=torch.float32)
        lps[row, :n] = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
    adv = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
    return Collated(
        input_ids=ids.to(device),
        attention_mask=attn.to(device),
        targets=ids[:, 1:].to(device),
        loss_mask=mask[:, 1:].to(device),
        rollout_logprobs=lps[:, 1:].to(device),
        advantages=adv.to(device),
    )
