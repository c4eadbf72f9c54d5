"""The learner's forward pass: next-token logprobs of a micro-batch, packed or padded.

A packed micro-batch (``core.collate.pack``) is one row holding several sequences back to back:
no pad token reaches the model. Two things keep the sequences independent:

- position ids restart at 0 at every sequence start (rotary embeddings see each sequence alone);
- the attention is block-diagonal. Where the model's attention is the plain causal kind that
  ``transformers`` dispatches through its ``AttentionInterface`` (Llama, Qwen, Mistral without a
  sliding window, …), each sequence's block runs as its own causal attention call
  (:func:`segment_attention`, registered as ``"spade_segments"``): no mask is materialised and no
  work is spent on the blocks off the diagonal, so attention costs ``Σ len²`` instead of
  ``(Σ len)²``. Each block attends through :mod:`spade.attention`'s kernel where it serves (2-3x
  SDPA's speed forward and backward on the AMD EPYC VM, in fp32), else through SDPA. Any other
  model falls back to ``transformers``' own packed-sequence support: with ``attention_mask=None``
  its masking utilities detect the restarts in ``position_ids`` (``find_packed_sequence_indices``)
  and build the block-diagonal causal mask for ``sdpa``/``eager``.

A row packed with shared prefixes (``pack(..., share_prefixes=True)``) holds a group's common tokens
once; segment attention runs each member's queries against them and then, causally, its own tokens
(``Collated.parents``, passed down as ``spade_parents``). Only segment attention can run such a row.

The LM head is patched to return the logprobs of the trained positions only (see
:func:`token_logprobs`).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from services.learner.core.collate import Collated
from spade import attention, cpu_linear

SEGMENT_ATTENTION = "spade_segments"
"""Name under which :func:`segment_attention` is registered in ``transformers``' ``AttentionInterface``."""

SHARED_PREFIXES = "spade_parents"
"""The forward's keyword argument that carries ``Collated.parents`` down to :func:`segment_attention`."""

_shared_calls = threading.local()
"""How many member segments :func:`segment_attention` ran against a shared prefix in this thread's
current forward: :func:`token_logprobs` checks that a shared row's parents reached the attention (a
model that dropped the keyword would attend each member from the wrong place, silently)."""


def segment_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal attention within each packed sequence, one SDPA call per sequence.

    Same signature as ``transformers``' attention functions: ``query`` is ``(1, heads, N, d)``,
    ``key``/``value`` ``(1, kv_heads, N, d)``; the sequence boundaries come as ``cu_seq_lens_q``
    (cumulative lengths, ``(S + 1,)``, as flash-attention's varlen kernels take them), and, for a row
    with shared prefixes, ``spade_parents``: the segment each segment continues (−1: none), whose keys
    and values its queries see in full before its own. Returns ``((1, N, heads, d), None)``.

    Raises:
        ValueError: No ``cu_seq_lens_q`` was passed (the model was not called by
            :func:`token_logprobs` on a packed batch), or the batch has more than one row.
    """
    bounds = kwargs.get("cu_seq_lens_q")
    if bounds is None or query.shape[0] != 1:
        raise ValueError(
            f"{SEGMENT_ATTENTION} attention needs one packed row and cu_seq_lens_q; got batch {query.shape[0]} "
            f"and cu_seq_lens_q={'missing' if bounds is None else 'given'} — call the model through token_logprobs"
        )
    gqa = query.shape[1] != key.shape[1]
    cuts = [int(b) for b in bounds.tolist()]
    parents = kwargs.get(SHARED_PREFIXES) or (-1,) * (len(cuts) - 1)
    kernel = dropout == 0.0 and attention.applies(query, key, value)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    parts = []
    for (a, b), parent in zip(itertools.pairwise(cuts), parents, strict=True):
        # A member of a shared prefix: its queries see the whole shared segment, then causally its own.
        keys, values, before = key[:, :, a:b], value[:, :, a:b], 0
        if parent >= 0:
            pa, pb = cuts[parent], cuts[parent + 1]
            keys = torch.cat([key[:, :, pa:pb], keys], dim=2)
            values = torch.cat([value[:, :, pa:pb], values], dim=2)
            before = pb - pa
            # getattr: a forward recomputed in another thread (activation checkpointing on a GPU's backward
            # thread) must not fail here; its own thread's count is not the one token_logprobs checks.
            _shared_calls.count = getattr(_shared_calls, "count", 0) + 1
        if kernel:  # query i sees the `before` keys and its own first i + 1
            parts.append(attention.causal_attention(query[0, :, a:b], keys[0], values[0], scale).unsqueeze(0))
            continue
        # SDPA: is_causal where nothing comes before, else a boolean mask (torch's causal_lower_right bias would
        # spare the tensor, but it checks the dtypes before autocast casts them, and under bf16 autocast the
        # query and value differ).
        visible = None
        if before:
            visible = torch.ones(b - a, keys.shape[2], dtype=torch.bool, device=query.device).tril(before)
        sdpa = nn.functional.scaled_dot_product_attention
        causal = not before
        parts.append(sdpa(query[:, :, a:b], keys, values, visible, dropout, causal, scale=scaling, enable_gqa=gqa))
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
    return out.transpose(1, 2).contiguous(), None


_registered = False


def _register() -> None:
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(SEGMENT_ATTENTION, segment_attention)
        _registered = True


def _text_config(model: nn.Module) -> Any:
    config = getattr(model, "config", None)
    if config is None:
        return None
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def segment_attention_applies(model: nn.Module) -> bool:
    """Whether the model's attention is plain causal attention that :func:`segment_attention` can replace.

    Models with sliding-window layers, logit soft-capping or an attention that does not dispatch
    through ``transformers``' ``AttentionInterface`` keep their own implementation (with the
    block-diagonal mask ``transformers`` builds from the position ids).
    """
    config = _text_config(model)
    can_set = getattr(model, "_can_set_attn_implementation", None)
    if config is None or not callable(can_set) or not can_set():
        return False
    if getattr(config, "_attn_implementation", None) not in ("sdpa", "eager", SEGMENT_ATTENTION):
        return False  # flash-attention kernels already run packed rows as varlen sequences
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        if any(t != "full_attention" for t in layer_types):
            return False
    elif getattr(config, "sliding_window", None) is not None:  # e.g. Mistral: a window on every layer
        return False
    return getattr(config, "attn_logit_softcapping", None) is None


@contextlib.contextmanager
def _attention(model: nn.Module, use_segments: bool) -> Iterator[None]:
    if not use_segments:
        yield
        return
    _register()
    set_impl: Any = model.set_attn_implementation
    base = _text_config(model)._attn_implementation
    if base == SEGMENT_ATTENTION:
        yield
        return
    set_impl(SEGMENT_ATTENTION)
    try:
        yield
    finally:
        set_impl(base)


def _chunk_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor, temperature: float
) -> torch.Tensor:
    logits = cpu_linear.linear(hidden, weight, bias)  # F.linear; oneDNN's for fp32 on the CPU
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def _output_head(model: nn.Module) -> nn.Linear | None:
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    return head if isinstance(head, nn.Linear) else None


def _fusable(model: nn.Module) -> bool:
    """Whether the LM head's output is the logits as they are (no soft-capping or scaling after it)."""
    text = _text_config(model)
    if text is None or _output_head(model) is None:
        return False
    post = ("logit_scale", "logits_scaling", "output_multiplier")
    scaled = any(getattr(text, k, None) not in (None, 1.0) for k in post)
    return not scaled and getattr(text, "final_logit_softcapping", None) is None


@contextlib.contextmanager
def _logprob_head(
    model: nn.Module, targets: torch.Tensor, mask: torch.Tensor, temperature: float, rows: int
) -> Iterator[None]:
    """Make the LM head return next-token logprobs ``(B, T−1)`` instead of logits ``(B, T, V)``.

    Only the trained positions (``mask``) go through the head, ``rows`` of them at a time, and each
    chunk's logits are recomputed in backward (activation checkpointing): the ``(B, T, V)`` logits
    and their gradient never exist, and prompt/observation tokens cost no head compute. Untrained
    positions hold 0. The head is patched on the instance, inside the model's own forward, so
    FSDP2's hooks on the root module still gather its weight.
    """
    head = _output_head(model)
    assert head is not None

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden[:, :-1]
        where = mask > 0
        if not bool(where.any()):
            # Nothing trains here (an inert micro-batch): still run one position through the head,
            # scaled by 0, so backward reaches every parameter (FSDP needs the collectives).
            where = torch.zeros_like(where)
            where[0, 0] = True
            scale = 0.0
        else:
            scale = 1.0
        picked_h, picked_t = hidden[where], targets[where]
        parts = []
        for start in range(0, picked_h.shape[0], rows):
            args = (picked_h[start : start + rows], head.weight, head.bias, picked_t[start : start + rows])
            if torch.is_grad_enabled():
                parts.append(checkpoint(_chunk_logprobs, *args, temperature, use_reentrant=False))
            else:
                parts.append(_chunk_logprobs(*args, temperature))
        flat = torch.cat(parts) * scale
        out = torch.zeros(hidden.shape[:2], dtype=flat.dtype, device=hidden.device)
        return out.index_put(where.nonzero(as_tuple=True), flat)

    head.forward = forward  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        del head.forward


def _model_inputs(model: nn.Module, batch: Collated) -> tuple[dict[str, Any], bool]:
    """The forward's keyword arguments, and whether segment attention runs them."""
    if batch.position_ids is None:
        return {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask, "use_cache": False}, False
    # Packed: no 2-D attention mask (transformers then reads the packing from the position ids), no
    # cache (a cache disables that detection).
    inputs: dict[str, Any] = {"input_ids": batch.input_ids, "position_ids": batch.position_ids, "use_cache": False}
    segments = segment_attention_applies(model)
    if batch.parents is not None and not segments:
        raise ValueError(
            "a row packed with shared prefixes needs segment attention, which this model's attention does not "
            "allow (segment_attention_applies): pack it without share_prefixes"
        )
    if segments:
        assert batch.cu_seqlens is not None
        inputs["cu_seq_lens_q"] = inputs["cu_seq_lens_k"] = batch.cu_seqlens
        inputs["max_length_q"] = inputs["max_length_k"] = batch.max_length
        if batch.parents is not None:
            inputs[SHARED_PREFIXES] = batch.parents
    return inputs, segments


def _check_shared(batch: Collated) -> None:
    """Raise unless a shared-prefix row's members were attended to their shared segments."""
    if batch.parents is not None and any(p >= 0 for p in batch.parents) and _shared_calls.count == 0:
        raise RuntimeError(
            f"the model's forward did not pass {SHARED_PREFIXES} down to its attention, so a row packed with "
            "shared prefixes was attended wrongly: train this model with share_prefixes off"
        )


def token_logprobs(
    model: nn.Module, batch: Collated, temperature: float = 1.0, *, logits_budget: int = 1 << 22, fused: bool = True
) -> torch.Tensor:
    """Logprob of each next token, ``(B, T−1)``, at least float32, at the sampling temperature.

    ``batch`` is packed (``core.collate.pack``: one row, no padding, per-sequence positions and
    attention) or padded (``core.collate.collate``: one row per sequence). With the fused head
    (the default) only positions where ``batch.loss_mask`` is set are computed; the others hold 0.

    Args:
        model: A Hugging Face causal LM.
        batch: The micro-batch.
        temperature: Logits are divided by it (the engine reports logprobs at its sampling temperature).
        logits_budget: Most logits elements materialised at once (fused head: 4M, 16 MB of fp32, 85 positions
            of SmolLM2's vocabulary; a chunk of 64 MB was mapped afresh and page-faulted at every call, as glibc
            serves blocks of over 32 MB); models whose head output is post-processed (soft-capping,
            scaling) compute full logits instead.
        fused: Use the fused head when the model allows it (``False``: full logits, every position).
    """
    inputs, segments = _model_inputs(model, batch)
    _shared_calls.count = 0
    with _attention(model, segments):
        if fused and _fusable(model):
            head = _output_head(model)
            assert head is not None
            rows = max(1, logits_budget // head.weight.shape[0])
            with _logprob_head(model, batch.targets, batch.loss_mask, temperature, rows):
                out: torch.Tensor = model(**inputs).logits
            _check_shared(batch)
            return out
        logits = model(**inputs).logits[:, :-1]
    _check_shared(batch)
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    picked = logits.gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)
