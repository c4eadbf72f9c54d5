"""Micro-batch tensors: samples (``core.batching.TrainSample``) packed or padded for the forward pass.

The only torch in the learner's core: the step plan (``core/plan.py``), advantages and bin packing
(``core/batching.py``) are pure Python, so they are tested and reasoned about without a framework.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.learner.core.batching import BatchError, TrainSample


@dataclass
class Collated:
    """The tensors of one micro-batch, aligned to next-token prediction.

    ``input_ids`` is ``(B, T)``; the target tensors are ``(B, T−1)``: position ``t`` holds the data
    of token ``t+1`` (predicted from the logits at ``t``).

    Two layouts:

    - **packed** (``pack``): ``B = 1``, the sequences back to back with no padding;
      ``position_ids`` restart at 0 at each sequence, ``cu_seqlens`` holds the cumulative lengths
      ``(S + 1,)``, ``attention_mask`` is ``None`` and ``advantages`` is per token ``(1, T−1)``;
    - **padded** (``collate``): one right-padded row per sequence, an ``attention_mask`` ``(B, T)``
      and ``advantages`` per sequence ``(B,)``.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    targets: torch.Tensor
    loss_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    advantages: torch.Tensor
    position_ids: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    max_length: int = 0
    constrained: torch.Tensor | None = None
    """``(B, T−1)`` bool, true on the tokens of constrained samples (``None`` when there are none):
    their rollout logprobs are replaced by the learner's own at the step (no importance ratio)."""

    def split(self, values: torch.Tensor) -> list[torch.Tensor]:
        """Per-sequence rows of a ``(B, T−1)`` tensor: sequence ``i``'s ``len_i − 1`` predictions."""
        if self.cu_seqlens is None:
            assert self.attention_mask is not None
            lengths = self.attention_mask.sum(dim=1).tolist()
            return [values[row, : int(n) - 1] for row, n in enumerate(lengths)]
        cuts = self.cu_seqlens.tolist()
        return [values[0, a : b - 1] for a, b in itertools.pairwise(cuts)]


def pack(samples: Sequence[TrainSample], device: torch.device | str = "cpu") -> Collated:
    """Pack samples into one row with no padding (see ``Collated``).

    The target of a sequence's last token is the next sequence's first token; it never trains,
    since a sequence's first token is never in its loss mask (``TrainSample`` enforces it).
    """
    if not samples:
        raise BatchError("cannot pack an empty micro-batch")
    ids = torch.tensor([t for s in samples for t in s.token_ids], dtype=torch.long)
    positions = torch.cat([torch.arange(len(s.token_ids), dtype=torch.long) for s in samples])
    mask = torch.tensor([float(m) for s in samples for m in s.loss_mask], dtype=torch.float32)
    lps = torch.tensor([x for s in samples for x in s.rollout_logprobs], dtype=torch.float32)
    adv = torch.tensor([s.advantage for s in samples for _ in s.token_ids], dtype=torch.float32)
    lengths = [len(s.token_ids) for s in samples]
    cu = torch.zeros(len(samples) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0)
    constrained = None
    if any(s.constrained for s in samples):
        flags = torch.tensor([s.constrained for s in samples for _ in s.token_ids], dtype=torch.bool)
        constrained = flags[None, 1:].to(device)
    return Collated(
        input_ids=ids[None].to(device),
        attention_mask=None,
        targets=ids[None, 1:].to(device),
        loss_mask=mask[None, 1:].to(device),
        rollout_logprobs=lps[None, 1:].to(device),
        advantages=adv[None, 1:].to(device),
        position_ids=positions[None].to(device),
        cu_seqlens=cu.to(device),
        max_length=max(lengths),
        constrained=constrained,
    )


def collate(samples: Sequence[TrainSample], pad_id: int = 0, device: torch.device | str = "cpu") -> Collated:
    """Pad samples into one micro-batch, one row each (see ``Collated``)."""
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
    constrained = None
    if any(s.constrained for s in samples):
        flags = torch.tensor([s.constrained for s in samples], dtype=torch.bool)[:, None].expand(b, width - 1)
        constrained = flags.to(device)
    return Collated(
        input_ids=ids.to(device),
        attention_mask=attn.to(device),
        targets=ids[:, 1:].to(device),
        loss_mask=mask[:, 1:].to(device),
        rollout_logprobs=lps[:, 1:].to(device),
        advantages=adv.to(device),
        constrained=constrained,
    )
