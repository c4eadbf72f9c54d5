"""Micro-batch tensors: samples (``core.batching.TrainSample``) packed or padded for the forward pass.

The only torch in the learner's core: the step plan (``core/plan.py``), advantages and bin packing
(``core/batching.py``) are pure Python, so they are tested and reasoned about without a framework.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.learner.core.batching import BatchError, TrainSample, prefix_groups


@dataclass
class Collated:
    """The tensors of one micro-batch, aligned to next-token prediction.

    ``input_ids`` is ``(B, T)``; the target tensors are ``(B, T−1)``: position ``t`` holds the data
    of token ``t+1`` (predicted from the logits at ``t``).

    Two layouts:

    - **packed** (``pack``): ``B = 1``, the sequences back to back with no padding;
      ``position_ids`` restart at 0 at each sequence, ``cu_seqlens`` holds the cumulative lengths
      ``(S + 1,)``, ``attention_mask`` is ``None`` and ``advantages`` is per token ``(1, T−1)``.
      Packed with shared prefixes (``pack(..., share_prefixes=True)``), a group of samples that begin
      alike is laid out as its shared tokens once, then each member's own tokens with positions that
      go on from the shared part; ``parents`` says which segment each segment continues;
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
    parents: tuple[int, ...] | None = None
    """Packed with shared prefixes: for each segment of ``cu_seqlens``, the index of the shared segment
    it continues (it attends to all of it), or −1 (a segment on its own). ``None``: no segment
    continues another."""
    sample_segments: tuple[int, ...] | None = None
    """Packed with shared prefixes: each sample's own segment, in the order the samples were given."""

    def split(self, values: torch.Tensor) -> list[torch.Tensor]:
        """Per-sequence rows of a ``(B, T−1)`` tensor: sequence ``i``'s ``len_i − 1`` predictions.

        With shared prefixes a sample's row is its shared segment's values (the last of them predicts
        the sample's first own token, the same token in every member) followed by its own segment's.
        """
        if self.cu_seqlens is None:
            assert self.attention_mask is not None
            lengths = self.attention_mask.sum(dim=1).tolist()
            return [values[row, : int(n) - 1] for row, n in enumerate(lengths)]
        cuts = self.cu_seqlens.tolist()
        if self.parents is None or self.sample_segments is None:
            return [values[0, a : b - 1] for a, b in itertools.pairwise(cuts)]
        rows = []
        for seg in self.sample_segments:
            own = values[0, cuts[seg] : cuts[seg + 1] - 1]
            parent = self.parents[seg]
            rows.append(own if parent < 0 else torch.cat([values[0, cuts[parent] : cuts[parent + 1]], own]))
        return rows


def pack(
    samples: Sequence[TrainSample], device: torch.device | str = "cpu", *, share_prefixes: bool = False
) -> Collated:
    """Pack samples into one row with no padding (see ``Collated``).

    The target of a sequence's last token is the next sequence's first token; it never trains,
    since a sequence's first token is never in its loss mask (``TrainSample`` enforces it).

    ``share_prefixes``: samples that begin alike (``core.batching.prefix_groups``) share those tokens:
    they are laid out once, and each member's own tokens continue them. Only the learner's segment
    attention (``logprobs.segment_attention``) runs such a row; every logprob is the one the
    sequence alone would get.
    """
    if not samples:
        raise BatchError("cannot pack an empty micro-batch")
    # One builder for both layouts: whole samples, in the order given, are groups of one sharing nothing.
    groups = prefix_groups(samples) if share_prefixes else []
    if not any(shared > 0 for shared, _ in groups):
        groups = [(0, [i]) for i in range(len(samples))]
    return _pack_groups(samples, groups, device)


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


def _pack_groups(
    samples: Sequence[TrainSample], groups: list[tuple[int, list[int]]], device: torch.device | str
) -> Collated:
    """``pack``'s row: each group's shared tokens once (``Collated.parents``), then each member's own.

    A shared segment carries its first member's tokens, which no member trains on (``shareable_prefix``);
    its targets, masks and logprobs are those of every member. The target of its last position is the
    next segment's first token: the first member's own first token, equal in every member.
    """
    ids: list[int] = []
    positions: list[int] = []
    mask: list[float] = []
    lps: list[float] = []
    adv: list[float] = []
    flags: list[bool] = []
    lengths: list[int] = []
    parents: list[int] = []
    sample_segments = [0] * len(samples)

    def segment(sample: TrainSample, start: int, stop: int, parent: int) -> None:
        n = stop - start
        ids.extend(sample.token_ids[start:stop])
        positions.extend(range(start, stop))
        mask.extend(float(m) for m in sample.loss_mask[start:stop])
        lps.extend(sample.rollout_logprobs[start:stop])
        adv.extend([sample.advantage] * n)
        flags.extend([sample.constrained] * n)
        lengths.append(n)
        parents.append(parent)

    for shared, members in groups:
        parent = -1
        if shared > 0:
            parent = len(lengths)
            segment(samples[members[0]], 0, shared, -1)
        for i in members:
            sample_segments[i] = len(lengths)
            segment(samples[i], shared, len(samples[i].token_ids), parent)
    shares = any(p >= 0 for p in parents)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0)
    ids_t = torch.tensor(ids, dtype=torch.long)
    constrained = torch.tensor(flags, dtype=torch.bool)[None, 1:].to(device) if any(flags) else None
    return Collated(
        input_ids=ids_t[None].to(device),
        attention_mask=None,
        targets=ids_t[None, 1:].to(device),
        loss_mask=torch.tensor(mask, dtype=torch.float32)[None, 1:].to(device),
        rollout_logprobs=torch.tensor(lps, dtype=torch.float32)[None, 1:].to(device),
        advantages=torch.tensor(adv, dtype=torch.float32)[None, 1:].to(device),
        position_ids=torch.tensor(positions, dtype=torch.long)[None].to(device),
        cu_seqlens=cu.to(device),
        max_length=max(n + (lengths[p] if p >= 0 else 0) for n, p in zip(lengths, parents, strict=True)),
        constrained=constrained,
        parents=tuple(parents) if shares else None,
        sample_segments=tuple(sample_segments) if shares else None,
    )
