"""Prefilling several prompts in one forward pass.

A prompt's prefill is one forward pass over the tokens the prefix cache does not hold. Alone, a short
one (an agent's next turn: a few dozen tokens after a cached conversation) costs nearly what a long one
does on CPU, because the pass's fixed cost (every layer's kernels launched once, every weight read once)
dwarfs its arithmetic. So the engine prefills the short prompts admitted together in one pass
(:func:`prefill_together`), grouped by :func:`group_prefills`.

Layout of a pass: every row feeds its last ``width`` tokens, ``width`` being the longest new part in
the group; the KV before them comes from the row's cached prefix, right-aligned and left-padded with
zeros (:class:`~services.inference.kv.KVBatch`, the decode batch's layout), so padded slots get
exactly zero attention weight. A row whose new part is shorter than ``width`` therefore recomputes the
last cached tokens before it (the same values, up to float rounding), and a row shorter than ``width``
in all cannot join: it would need padded *queries*, whose fully masked attention is undefined.
Batching changes a prompt's logits only by floating-point reassociation, as decode batching does.

Where the engine serves rounded weights (:func:`use_prompt_attention`), a pass's attention goes through
:mod:`spade.attention`'s kernel, one call per row on the row's keys after its padding, whenever SDPA's mask
is causal after each row's cached prefix: a prompt alone, and the rows of :func:`prefill_together`. On the
AMD EPYC VM torch's SDPA was half of a 1,000-token prefill. Every other pass (another mask, fp32 weights,
whose prefills give transformers' logits bit for bit) keeps SDPA.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from services.inference.kv import KVBatch, layer_kv
from spade import attention

KV = list[tuple[torch.Tensor, torch.Tensor]]

PAD_SLACK = 1.5
"""A group's pass may compute at most this many times the tokens its prompts need (new parts)."""

SHARED_MIN = 16
"""A prompt that shares this many tokens more with an earlier prompt admitted with it than the cache
gives it waits for that one's KV (:func:`defer_shared`)."""


@dataclass(frozen=True)
class Prompt:
    """A prompt to prefill: its tokens and the prefix the cache gave it (``reused`` tokens' KV)."""

    ids: Sequence[int]
    reused: int
    prefix: KV | None

    @property
    def new(self) -> int:
        return len(self.ids) - self.reused


def group_prefills(prompts: Sequence[Prompt], max_tokens: int) -> list[list[int]]:
    """Partition ``prompts`` (by index) into groups to prefill one pass each.

    A group's pass computes ``len(group) * width`` tokens (``width``: its longest new part); a group
    takes a prompt only while that stays within ``max_tokens`` and within :data:`PAD_SLACK` times the
    group's new tokens, and while every member is at least ``width`` tokens long. Prompts whose new
    part alone is more than half of ``max_tokens`` are compute-bound anyway and go alone. Groups keep
    admission order inside; ``max_tokens <= 0`` puts every prompt alone.
    """
    alone = [[i] for i, p in enumerate(prompts) if max_tokens <= 0 or 2 * p.new > max_tokens]
    if max_tokens <= 0:
        return alone
    short = sorted((i for i, p in enumerate(prompts) if 2 * p.new <= max_tokens), key=lambda i: prompts[i].new)
    groups: list[list[int]] = []
    group: list[int] = []
    for i in short:
        members = [*group, i]
        width = prompts[i].new  # sorted: the newcomer's new part is the longest
        fits = (
            len(members) * width <= max_tokens
            and len(members) * width <= PAD_SLACK * sum(prompts[j].new for j in members)
            and min(len(prompts[j].ids) for j in members) >= width
        )
        if group and not fits:
            groups.append(group)
            members = [i]
        group = members
    if group:
        groups.append(group)
    return sorted([sorted(g) for g in groups] + alone, key=lambda g: g[0])


def defer_shared(prompts: Sequence[Prompt]) -> tuple[list[int], list[int]]:
    """Split ``prompts`` (by index) into those to prefill now and those to prefill after them.

    Prompts admitted together often share a prefix the cache does not hold yet (the plays of one
    env's first turn, the designer's attempts on one corpus). Prefilled one after another, each
    reused what the one before had just cached; prefilled in one pass, each would compute it again.
    So a prompt that shares at least :data:`SHARED_MIN` more tokens with an earlier one than the
    cache gives it waits, to be matched again once that one's KV is cached.
    """
    tensors = [torch.tensor(list(p.ids)) for p in prompts]
    now: list[int] = []
    later: list[int] = []
    for j, p in enumerate(prompts):
        m = p.reused + SHARED_MIN
        shares = len(p.ids) > m and any(
            len(prompts[i].ids) >= m and torch.equal(tensors[i][:m], tensors[j][:m]) for i in range(j)
        )
        (later if shares else now).append(j)
    return now, later


def cache_of(kv: KV, config: Any) -> DynamicCache:
    """A ``DynamicCache`` holding ``kv`` (a batch of one)."""
    cache = DynamicCache(config=config)
    for index, (keys, values) in enumerate(kv):
        cache.update(keys, values, index)
    return cache


def prefill_together(
    forward: Callable[..., torch.Tensor], config: Any, prompts: Sequence[Prompt]
) -> list[tuple[KV, torch.Tensor]]:
    """Prefill ``prompts`` (a group of :func:`group_prefills`) in one forward pass.

    Returns, per prompt, its whole KV (per layer ``[1, kv_heads, len(ids), head_dim]``, views of the
    pass's buffer: copy what outlives the next pass) and its last position's logits (``[1, vocab]``).
    """
    width = max(p.new for p in prompts)
    if any(len(p.ids) < width for p in prompts):
        raise ValueError("every prompt of a batched prefill must be at least as long as its longest new part")
    # Tokens each row takes from its cached prefix (at most ``reused``: ``width`` >= its new part).
    kept = [len(p.ids) - width for p in prompts]
    rows = len(prompts)
    batch = KVBatch()
    source = next((p.prefix for p, keep in zip(prompts, kept, strict=True) if keep), None)
    if source is None:  # no row keeps a cached token: nothing before the pass's columns
        cache, cached = DynamicCache(config=config), torch.zeros((rows, 0), dtype=torch.long)
    else:
        # A row without a prefix keeps nothing: an empty slice of another row's prefix stands for it.
        batch.add_rows(
            [
                cache_of([(k[:, :, :keep], v[:, :, :keep]) for k, v in (p.prefix or source)], config)
                for p, keep in zip(prompts, kept, strict=True)
            ]
        )
        assert batch.cache is not None
        cache, cached = batch.cache, batch.mask
    mask = torch.cat([cached, torch.ones((rows, width), dtype=torch.long)], dim=1)
    logits = forward(
        input_ids=torch.tensor([list(p.ids[keep:]) for p, keep in zip(prompts, kept, strict=True)]),
        position_ids=torch.stack([torch.arange(keep, keep + width) for keep in kept]),
        attention_mask=mask,
        cache=cache,
        logits_to_keep=1,
    )
    layers_kv = [layer_kv(layer) for layer in cache.layers]
    out: list[tuple[KV, torch.Tensor]] = []
    for row, p in enumerate(prompts):
        start = mask.shape[1] - len(p.ids)
        kv = [(k[row : row + 1, :, start:], v[row : row + 1, :, start:]) for k, v in layers_kv]
        out.append((kv, logits[row, -1:]))
    return out


PROMPT_ATTENTION = "spade_prompt"
"""The name :func:`prompt_attention` is registered under in ``transformers``' ``AttentionInterface`` (with
SDPA's masks, so every pass it does not take gets exactly what SDPA would)."""

_causal_masks: list[tuple[weakref.ref[torch.Tensor], tuple[int, ...], list[int] | None]] = []
"""The last mask :func:`_rows_padding` checked, for which shape, and its verdict: every layer of a pass gets the
same one."""


def _rows_padding(mask: torch.Tensor | None, rows: int, queries: int, keys: int) -> list[int] | None:
    """Each row's left padding ``p`` where SDPA with ``mask`` attends the row's query ``i`` to its keys
    ``[p, keys - queries + i]``, as the kernel does on the row's keys from ``p`` on; ``None`` for any other mask.

    Only the padding of a row's cached prefix qualifies (``p <= keys - queries``): a padded query's fully
    masked attention is undefined, and :func:`prefill_together` never makes one.
    """
    if mask is None:  # SDPA then attends causally (queries == keys) or to every key (a single query)
        return [0] * rows if queries in (keys, 1) else None
    shape = (rows, 1, queries, keys)
    if _causal_masks:
        ref, seen, verdict = _causal_masks[-1]
        if ref() is mask and seen == shape:
            return verdict
    verdict = None
    if mask.dtype == torch.bool and tuple(mask.shape) == shape:
        causal = torch.ones(queries, keys, dtype=torch.bool).tril(keys - queries)
        pads = (~mask[:, 0, -1]).sum(dim=1).tolist()  # a row's last query sees every key after its padding
        columns = torch.arange(keys)
        if all(pad <= keys - queries for pad in pads) and all(
            torch.equal(mask[row, 0], causal & (columns >= pad)) for row, pad in enumerate(pads)
        ):
            verdict = [int(pad) for pad in pads]
    _causal_masks[:] = [(weakref.ref(mask), shape, verdict)]
    return verdict


def prompt_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``transformers``' attention signature: causal rows after their cached prefixes (one prompt alone, or
    the prompts :func:`prefill_together` pads into one pass) through :func:`spade.attention.causal_attention`,
    each row on its keys after its padding; anything else through SDPA as ``sdpa`` would (among them a decode
    step of several rows through transformers' forward, whose numbers the docs promise to be SDPA's)."""
    rows, queries, keys = query.shape[0], query.shape[2], key.shape[2]
    pads = (
        _rows_padding(attention_mask, rows, queries, keys)
        if (
            (rows == 1 or queries > 1)  # several rows of one query each: a decode step, which SDPA serves
            and dropout == 0.0
            and queries <= keys
            and getattr(module, "is_causal", True)
            and kwargs.get("is_causal") is not False
            and not kwargs.get("softcap")
            and not kwargs.get("output_attentions")
            and kwargs.get("position_bias") is None
            and attention.applies(query, key, value)
        )
        else None
    )
    if pads is not None:
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        out = torch.stack(
            [
                attention.causal_attention(query[row], key[row, :, pad:], value[row, :, pad:], scale)
                for row, pad in enumerate(pads)
            ]
        )
        return out.transpose(1, 2).contiguous(), None
    result: tuple[torch.Tensor, None] = sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
    )
    return result


_registered: list[bool] = []


def use_prompt_attention(model: nn.Module) -> bool:
    """Make ``model`` (a ``transformers`` model on SDPA) prefill through :func:`prompt_attention`, where the
    attention kernel is available (:func:`spade.attention.kernel`); returns whether it does."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa" or attention.kernel() is None:
        return False
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionInterface.register(PROMPT_ATTENTION, prompt_attention)
        AttentionMaskInterface.register(PROMPT_ATTENTION, sdpa_mask)
        _registered.append(True)
    model.set_attn_implementation(PROMPT_ATTENTION)  # type: ignore[operator]
    return True
