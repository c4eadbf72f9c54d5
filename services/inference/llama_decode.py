"""A decode step for Llama-family models without transformers' per-call plumbing.

A decode step feeds one token per row through the model. In transformers' ``LlamaForCausalLM``
that pass also builds a 4-D mask, routes every attention call through the attention interface,
merges keyword arguments and output dataclasses at every layer and applies rotary embeddings with
a slice-and-concatenate per tensor: about 2,000 small operations a step for the default model's 30
layers, beside 211 matrix products. On two CPU cores that plumbing is a fifth to a third of a
one-row step (docs/inference.md, "A decode step without transformers' plumbing").

:class:`LlamaDecoder` computes the same step from the same modules (the served linear layers,
packed or quantized, are called as they are) with:

- the padding mask turned into SDPA's boolean mask once a step, not once per layer;
- cos/sin for the step's positions from the model's own rotary module, once a step, with the
  rotation's sign folded into the sine (``rotate_half(x) * sin == roll(x, d/2) * signed_sin``, exactly:
  negation is exact in floating point);
- q, k and v multiplied by one product (their weights stacked), and gate and up by another, where the
  served layers are fp32, bf16 or int8 ones (:func:`.quant.stacked_product`); otherwise one product each;
- attention exactly as transformers' SDPA integration computes a one-token query: grouped query
  heads packed onto their key/value head, the boolean mask where a row has padding.

Only a plain ``LlamaForCausalLM`` is served this way (:func:`llama_decoder` says which models qualify);
any other model, and every prefill, keeps transformers' forward. The logits are the HF forward's up
to fp32 rounding (``tests/integration/inference/test_llama_decode.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import DynamicCache

from services.inference.quant import stacked_product

Product = Callable[[torch.Tensor], torch.Tensor]


def _separate(layers: list[Any]) -> Product:
    """The layers' own products, one after another, side by side (no stacked weights for them)."""
    return lambda x: torch.cat([layer(x) for layer in layers], dim=-1)


@dataclass(frozen=True)
class _Layer:
    norm_in: torch.Tensor
    eps_in: float
    qkv: Product
    o_proj: Any
    norm_post: torch.Tensor
    eps_post: float
    gate_up: Product
    down_proj: Any


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``LlamaRMSNorm`` on fp32 hidden states, operation for operation."""
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps))


class LlamaDecoder:
    """One decode step of a ``LlamaForCausalLM`` (see the module docstring).

    Build it with :func:`llama_decoder`, once per served model: it holds the stacked products of that
    model's weights, so a weight swap needs a new one.
    """

    def __init__(self, model: Any) -> None:
        config = model.config
        inner = model.model
        self.embed = inner.embed_tokens
        self.rotary = inner.rotary_emb
        self.norm = inner.norm
        self.lm_head = model.lm_head
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        self.scaling = self.head_dim**-0.5
        layers = []
        for layer in inner.layers[: config.num_hidden_layers]:
            attn, mlp = layer.self_attn, layer.mlp
            qkv_layers, gate_up_layers = [attn.q_proj, attn.k_proj, attn.v_proj], [mlp.gate_proj, mlp.up_proj]
            layers.append(
                _Layer(
                    norm_in=layer.input_layernorm.weight,
                    eps_in=float(layer.input_layernorm.variance_epsilon),
                    qkv=stacked_product(qkv_layers) or _separate(qkv_layers),
                    o_proj=attn.o_proj,
                    norm_post=layer.post_attention_layernorm.weight,
                    eps_post=float(layer.post_attention_layernorm.variance_epsilon),
                    gate_up=stacked_product(gate_up_layers) or _separate(gate_up_layers),
                    down_proj=mlp.down_proj,
                )
            )
        self.layers = layers

    def __call__(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor, cache: DynamicCache
    ) -> torch.Tensor:
        """Logits ``[rows, vocab]`` of one step.

        Args:
            input_ids: ``[rows, 1]``, each row's next token.
            position_ids: ``[rows, 1]``, its position.
            mask: ``[rows, length]``, 1 for a real token of the cache (this step's included), 0 for padding.
            cache: the batch's KV cache (``length - 1`` positions before the step), appended to.
        """
        rows = input_ids.shape[0]
        hidden = self.embed(input_ids)
        cos, sin = self.rotary(hidden, position_ids)  # [rows, 1, head_dim]
        half = self.head_dim // 2
        cos = cos.unsqueeze(1)
        signed_sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1).unsqueeze(1)
        padded = not bool(mask.all())
        attn_mask = mask.bool()[:, None, None, :] if padded else None
        groups = self.heads // self.kv_heads
        q_heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        for index, layer in enumerate(self.layers):
            residual = hidden
            x = _rms_norm(hidden, layer.norm_in, layer.eps_in)
            # [rows, 1, heads + 2 kv_heads, dim] -> [rows, heads + 2 kv_heads, 1, dim]
            qkv = layer.qkv(x).view(rows, 1, q_heads + 2 * kv_heads, dim).transpose(1, 2)
            qk = qkv[:, : q_heads + kv_heads]
            qk = qk * cos + qk.roll(half, dims=-1) * signed_sin
            query, key = qk[:, :q_heads], qk[:, q_heads:]
            value = qkv[:, q_heads + kv_heads :]
            key, value = cache.layers[index].update(key, value)  # type: ignore[union-attr]
            if padded or groups == 1 or dim > 256:
                # transformers' one-token path (sdpa_attention_forward: no enable_gqa with a mask or heads
                # wider than 256): each key/value head's query heads as its query positions.
                out = nn.functional.scaled_dot_product_attention(
                    query.reshape(rows, kv_heads, groups, dim), key, value, attn_mask=attn_mask, scale=self.scaling
                )
            else:
                out = nn.functional.scaled_dot_product_attention(query, key, value, scale=self.scaling, enable_gqa=True)
            out = out.reshape(rows, q_heads, 1, dim).transpose(1, 2).reshape(rows, 1, q_heads * dim)
            hidden = residual + layer.o_proj(out)
            residual = hidden
            x = _rms_norm(hidden, layer.norm_post, layer.eps_post)
            gate, up = layer.gate_up(x).chunk(2, dim=-1)  # gate and up: intermediate_size each
            hidden = residual + layer.down_proj(nn.functional.silu(gate) * up)
        hidden = _rms_norm(hidden, self.norm.weight, float(self.norm.variance_epsilon))
        return self.lm_head(hidden[:, -1, :])


def llama_decoder(model: Any) -> LlamaDecoder | None:
    """A :class:`LlamaDecoder` for ``model``, or ``None`` where the model is not one it computes exactly.

    It must be a ``LlamaForCausalLM`` with SDPA attention, fp32 hidden states, SiLU MLPs, RMS norms, and
    layers, attention, MLPs and rotary embedding of transformers' own classes, without module hooks
    (offloading, adapters) on its layers. The engine never installs hooks; a library that replaces a
    module's ``forward`` instead of hooking it is not detected.
    """
    from transformers.models.llama import modeling_llama as llama

    if type(model) is not llama.LlamaForCausalLM:
        return None
    config = model.config
    if config._attn_implementation != "sdpa" or config.hidden_act != "silu":
        return None
    if model.model.embed_tokens.weight.dtype != torch.float32:
        return None
    if type(model.model.rotary_emb) is not llama.LlamaRotaryEmbedding:
        return None
    norms = [model.model.norm]
    for layer in model.model.layers:
        kinds = (type(layer), type(layer.self_attn), type(layer.mlp))
        if kinds != (llama.LlamaDecoderLayer, llama.LlamaAttention, llama.LlamaMLP):
            return None
        norms += [layer.input_layernorm, layer.post_attention_layernorm]
    if any(type(norm) is not llama.LlamaRMSNorm for norm in norms):
        return None
    if any(m._forward_hooks or m._forward_pre_hooks for m in model.modules()):
        return None
    return LlamaDecoder(model)
