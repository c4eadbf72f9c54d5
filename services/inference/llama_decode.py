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
- attention exactly as transformers' SDPA integration computes a one-token query: grouped query heads packed
  onto their key/value head, the boolean mask where a row has padding; or, where every product of the step
  multiplies bf16 or int8 weights through the engine's own decode kernel (:func:`.rows.decodes_here`; on an
  AVX-512 CPU a bf16 step of a few rows, or more with a long context, :func:`.rows.bf16_kernel_wins`), the
  kernel's attention (:func:`.rows.decode_attention`), which reads the KV at 1.5-2.9x SDPA's rate (AVX2
  and AVX-512 VMs) and skips a row's padding. Its outputs differ from SDPA's by fp32 rounding (~5e-7). That
  moved the model's logprobs by up to 5e-5 over four steps: far inside what bf16 or int8 weights move them
  (5e-3 and more), but not the 1e-5 fp32 serving keeps, so fp32 weights keep SDPA; and beside products that
  round activations to bf16 (int4's torch kernel, oneDNN's bf16 steps of more rows) it turned into 0.2-0.26,
  so those steps keep SDPA too. Where the kernel's own bf16 products round activations to bf16 (a CPU with
  AVX-512 BF16, :func:`.rows.multiplies_bf16`) its attention serves beside them: every bf16 product there
  rounds activations (prefills, oneDNN's steps, the learner's autocast), which resolve the logprobs no finer
  than ~0.15 over the vocabulary whichever attention, and the kernel's attention is the faster one. There the
  batch's KV is kept in bf16 too (:attr:`LlamaDecoder.kv_dtype`), which the kernel widens exactly;
- for rounded weights (bf16, int8, int4), the norms, the rotary embedding and SiLU times the up projection as
  one kernel call each (:attr:`LlamaDecoder.fused`), each layer's output added to the residual stream by the
  norm that reads it next. The rotary embedding gives transformers' bits; the norms' sums and SiLU's exp
  have their own fixed order (within 2e-6 of torch's), which beside products that round activations to bf16
  moves logprobs as much as the attention's rounding does. fp32 weights keep torch's operators.

:meth:`LlamaDecoder.apart` decodes the batch-invariant mode's rows (:mod:`.invariance`) together:
each attends to its own KV, unpadded, and only the matrix products see the rows side by side, where
a probe shows this CPU's kernels give a row the same bits whatever rows are beside it
(:func:`row_invariant_from`).

Only a plain ``LlamaForCausalLM`` is served this way (:func:`llama_decoder` says which models qualify);
any other model, and every prefill, keeps transformers' forward. With fp32 weights the logits are the HF
forward's up to fp32 rounding; with rounded weights, those of the HF forward computing with the same
attention and fused operations (``tests/integration/inference/test_llama_decode.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import DynamicCache

from services.inference import rows as rows_kernel
from services.inference.prefill import PROMPT_ATTENTION
from services.inference.quant import (
    Bf16Linear,
    Int4Linear,
    Int8Linear,
    bf16_rows_kernel_takes,
    decode_step,
    decodes_through_rows_kernel,
    stacked_product,
)

Product = Callable[[torch.Tensor], torch.Tensor]
_Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

APART_MOST_ROWS = 32
"""Most rows of one :meth:`LlamaDecoder.apart` step: the largest row count :func:`row_invariant_from` probes."""

_PROBED_ROWS = (1, 2, 3, 5, 8, 13, APART_MOST_ROWS)
_probes: dict[tuple[Any, ...], int | None] = {}


def row_invariant_from(kind: type, inputs: int, outputs: int) -> int | None:
    """The fewest rows (1 or 2) from which a served layer's decode product gives a row the same bits
    whatever else it multiplies; ``None`` if no count from 2 on does.

    A CPU GEMM may block a product by its row count: oneDNN's products here sum a row of 1,536 inputs
    in another order alone than beside other rows (every count from two on agrees), and MKL's sgemm
    moves a row with the others' count. Bf16 and int8 outputs round most such differences away, but
    not all (one output of a step in a few hundred flips its last bit), and a flipped bit flips a
    sampled token sooner or later. So the probe makes any change of order show: a layer of ``kind`` and
    this shape with weights ±1 (exact in every format; inputs ``i`` and ``i + inputs/2`` share each
    output's), fed rows of small integers where a quarter of the inputs hold ``±2^25`` and their partners
    the opposite: in every output the large ones cancel, but meanwhile swallow the small ones, and
    differently in each order of summation. A row is placed first, in the middle and last among other
    such rows, for counts up to :data:`APART_MOST_ROWS`. The answer depends on the kernel, not the
    weights: it is kept per kind, shape and thread count for the process.
    """
    key = (kind, inputs, outputs, torch.get_num_threads())
    if key not in _probes:
        _probes[key] = _probe(kind, inputs, outputs)
    return _probes[key]


def _probe(kind: type, inputs: int, outputs: int) -> int | None:
    generator = torch.Generator().manual_seed(0)
    half = inputs // 2
    signs = torch.randint(0, 2, (outputs, half), generator=generator).float() * 2 - 1
    linear = nn.Linear(inputs, outputs, bias=False)
    with torch.no_grad():  # input i and input i + half share each output's weight (±1, exact in any format)
        linear.weight.copy_(torch.cat([signs, signs, torch.ones(outputs, inputs - 2 * half)], dim=1))
    try:
        layer = linear if kind is nn.Linear else kind(linear)
    except Exception:  # a layer class the probe cannot build: decode its rows alone
        return None

    def rows(count: int) -> torch.Tensor:
        x = torch.randint(1, 4, (count, 1, inputs), generator=generator).float()
        for row in x:
            big = torch.randperm(half, generator=generator)[: half // 2]
            sign = torch.randint(0, 2, (big.numel(),), generator=generator).float() * 2 - 1
            row[0, big] = sign * 2.0**25
            row[0, big + half] = -sign * 2.0**25
        return x

    target = rows(1)
    outs: dict[int, list[torch.Tensor]] = {}
    with torch.inference_mode(), decode_step(invariant=True):  # the products apart() takes
        for count in _PROBED_ROWS:
            for place in sorted({0, count // 2, count - 1}):
                x = rows(count)
                x[place] = target[0]
                outs.setdefault(count, []).append(layer(x)[place])
    first = outs[_PROBED_ROWS[1]][0]
    if not all(torch.equal(out, first) for count in _PROBED_ROWS[1:] for out in outs[count]):
        return None
    return 1 if torch.equal(outs[1][0], first) else 2


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


def _kind(layer: Any) -> tuple[type, int, int]:
    return type(layer), int(layer.in_features), int(layer.out_features)


def _product(layers: list[Any]) -> tuple[Product, list[tuple[type, int, int]]]:
    """The step's product of ``layers`` (stacked where :func:`.quant.stacked_product` can, else one each)
    and its kinds: ``(layer class, inputs, outputs)`` of each product taken."""
    shapes = [_kind(m) for m in layers]
    stacked = stacked_product(layers)
    if stacked is None:
        return _separate(layers), shapes
    return stacked, [(shapes[0][0], shapes[0][1], sum(out for _, _, out in shapes))]


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
        layers: list[_Layer] = []
        kinds = {_kind(self.lm_head)}
        served = [self.lm_head]  # every linear layer a step multiplies
        for layer in inner.layers[: config.num_hidden_layers]:
            attn, mlp = layer.self_attn, layer.mlp
            served += [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
            qkv, qkv_kinds = _product([attn.q_proj, attn.k_proj, attn.v_proj])
            gate_up, gate_up_kinds = _product([mlp.gate_proj, mlp.up_proj])
            kinds.update([*qkv_kinds, *gate_up_kinds, _kind(attn.o_proj), _kind(mlp.down_proj)])
            layers.append(
                _Layer(
                    norm_in=layer.input_layernorm.weight,
                    eps_in=float(layer.input_layernorm.variance_epsilon),
                    qkv=qkv,
                    o_proj=attn.o_proj,
                    norm_post=layer.post_attention_layernorm.weight,
                    eps_post=float(layer.post_attention_layernorm.variance_epsilon),
                    gate_up=gate_up,
                    down_proj=mlp.down_proj,
                )
            )
        self.layers = layers
        self._kinds = sorted(kinds, key=repr)
        """Every kind of product a step takes: ``(layer class, inputs, outputs)``."""
        #: Whether attention runs through the engine's kernel (else SDPA, as transformers runs it): where every
        #: layer decodes through the kernel, in the steps whose products all take it (:meth:`_attends_itself`).
        self.own_attention = all(map(decodes_through_rows_kernel, served)) and rows_kernel.attention_fits(self.head_dim)
        #: Whether bf16 products take the kernel in some steps only (beside oneDNN's,
        #: :func:`.quant.bf16_rows_kernel_takes`).
        self._bf16_beside_onednn = any(isinstance(m, Bf16Linear) and m.packed16 is not None for m in served)
        #: What a decode batch's keys and values may be kept in for these steps: bf16 where bf16 products
        #: multiply natively through the kernel (:func:`.rows.multiplies_bf16`) and its attention serves them,
        #: which reads each key and value widened exactly (half the bytes: at 4 rows of 1,000 positions the
        #: attention is about a third of a step, bound by the memory). The keys and values are rounded
        #: once, as they are written; the learner's bf16 autocast computes its attention on bf16 keys and
        #: values too. fp32 everywhere else, or where ``SPADE_ROWS_BF16_KV=0``.
        bf16_weights = any(isinstance(m, Bf16Linear) for m in served)
        self.kv_dtype = (
            torch.bfloat16 if self.own_attention and bf16_weights and rows_kernel.keeps_bf16_kv() else torch.float32
        )
        #: The kernel whose fused norms, rotary embedding and SiLU a step of rounded (bf16, int8, int4) weights
        #: runs (one call each where torch took several operators: at 4-8 rows their dispatch was a tenth to a
        #: fifth of a step), or ``None``: torch's operators (fp32 weights, no kernel here, or
        #: ``SPADE_ROWS_FUSED=0``). The same arithmetic up to the order of the norms' sums and the SiLU's exp;
        #: each row computed alone either way. fp32 weights keep torch's, so that their steps keep giving
        #: transformers' logits bit for bit (the fused norm's order moved them by up to 6e-5).
        quantized = any(isinstance(m, (Bf16Linear, Int8Linear, Int4Linear)) for m in served)
        self.fused = rows_kernel.fused_elementwise() if quantized else None

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
        padded = not bool(mask.all())
        attn_mask = mask.bool()[:, None, None, :] if padded else None

        def attend(index: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
            key, value = cache.layers[index].update(key, value)  # type: ignore[union-attr]
            return self._attention(query, key, value, attn_mask)

        with decode_step(positions=mask.shape[-1]):  # how long a context the step attends to
            return self._step(input_ids, position_ids, attend)

    def apart(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, caches: Sequence[DynamicCache]
    ) -> torch.Tensor:
        """Logits ``[rows, vocab]`` of one step of rows that share no pass: batch-invariant ones.

        Each row attends to its own cache alone, unpadded, exactly as a one-row step does. Only the
        matrix products see the rows together, each layer's of one kind at every row count (a batch-invariant
        :func:`.quant.decode_step`), and :attr:`rows_apart` says at which row counts they give every row the
        numbers it gets in any other such step. A step of fewer rows than that is
        filled up with copies of its first row, whose logits are dropped.

        Args:
            input_ids: ``[rows, 1]``, each row's next token.
            position_ids: ``[rows, 1]``, its position.
            caches: each row's own one-row KV cache, appended to.

        Raises:
            ValueError: The products are not row-invariant on this CPU (:attr:`rows_apart` is ``None``),
                or more rows than :data:`APART_MOST_ROWS`.
        """
        least = self.rows_apart
        rows = input_ids.shape[0]
        if least is None or rows > APART_MOST_ROWS or rows != len(caches):
            raise ValueError(
                f"cannot decode {rows} rows on {len(caches)} caches apart (row-invariant from {least} rows, "
                f"at most {APART_MOST_ROWS}); decode each alone"
            )
        filler = max(0, least - rows)
        if filler:
            input_ids = torch.cat([input_ids, input_ids[:1].expand(filler, -1)])
            position_ids = torch.cat([position_ids, position_ids[:1].expand(filler, -1)])

        def attend(index: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
            outs = []
            for row, cache in enumerate(caches):
                k, v = cache.layers[index].update(key[row : row + 1], value[row : row + 1])  # type: ignore[union-attr]
                outs.append(self._attention(query[row : row + 1], k, v, None))
            outs += outs[:1] * filler
            return torch.cat(outs)

        with decode_step(invariant=True):  # one kind of product at every row count
            return self._step(input_ids, position_ids, attend)[:rows]

    def _attention(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None
    ) -> torch.Tensor:
        """Attention of a one-token query as transformers' SDPA integration computes it, or through the
        engine's kernel (:meth:`_attends_itself`): ``[rows, heads, 1, dim]`` either way, in memory."""
        if self._attends_itself(query.shape[0]):
            keep = None if attn_mask is None else attn_mask.reshape(attn_mask.shape[0], -1)
            return rows_kernel.decode_attention(query, key, value, keep, self.scaling)
        if key.dtype != query.dtype:  # a bf16 batch (kv_dtype) in a step of more rows than the kernel takes
            key, value = key.to(query.dtype), value.to(query.dtype)
        groups = self.heads // self.kv_heads
        if attn_mask is not None or groups == 1 or self.head_dim > 256:
            # transformers' one-token path (sdpa_attention_forward: no enable_gqa with a mask or heads
            # wider than 256): each key/value head's query heads as its query positions.
            return nn.functional.scaled_dot_product_attention(
                query.reshape(query.shape[0], self.kv_heads, groups, self.head_dim),
                key,
                value,
                attn_mask=attn_mask,
                scale=self.scaling,
            )
        return nn.functional.scaled_dot_product_attention(query, key, value, scale=self.scaling, enable_gqa=True)

    def _attends_itself(self, rows: int) -> bool:
        """Whether a step's attention of ``rows`` query rows goes through the kernel: where every product of
        the step does (their activations fp32, or bf16 where :func:`.rows.multiplies_bf16`: see the module
        docstring). Beside oneDNN's bf16 steps of more rows and int4's products the kernel's fp32 rounding,
        ~5e-7 from SDPA's, moved logprobs by up to 0.2, so they keep SDPA."""
        return self.own_attention and (not self._bf16_beside_onednn or bf16_rows_kernel_takes(rows))

    @functools.cached_property
    def rows_apart(self) -> int | None:
        """The fewest rows from which this model's products are row-invariant here, or ``None``.

        Row-invariant: a row's output does not depend on the other rows of the product, their number
        (from this count up to :data:`APART_MOST_ROWS`) or its place among them. The batch-invariant
        mode decodes its rows together only then (:meth:`apart`); otherwise each alone. Probed once per
        kind of product, shape and thread count in this process (:func:`row_invariant_from`, about 0.6 s
        for the default model's five). Only the products are probed: the step's other operations (norms,
        rotary embedding, activations) compute each row on its own (``test_llama_decode.py`` checks
        whole steps bit for bit).
        """
        found = [row_invariant_from(kind, inputs, outputs) for kind, inputs, outputs in self._kinds]
        return None if None in found else max(f for f in found if f is not None)

    def _step(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attend: _Attend) -> torch.Tensor:
        """The step's arithmetic around ``attend(layer index, query, key, value)`` (which appends the KV), its
        elementwise operations the kernel's (:attr:`fused`) or torch's (:class:`_TorchOps`): each layer's output
        is added to the residual stream (in place) by the norm that reads it next."""
        ops: Any = self.fused if self.fused is not None else _TorchOps
        rows = input_ids.shape[0]
        hidden = self.embed(input_ids)  # [rows, 1, hidden]: a fresh tensor, the residual stream
        cos, sin = self.rotary(hidden, position_ids)  # [rows, 1, head_dim]
        cos, sin = cos.reshape(rows, -1).contiguous(), sin.reshape(rows, -1).contiguous()
        q_heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        heads = q_heads + 2 * kv_heads
        pending: torch.Tensor | None = None  # the last MLP's output, added by the next norm
        for index, layer in enumerate(self.layers):
            x = ops.rms_norm(hidden, pending, layer.norm_in, layer.eps_in)
            qkv = layer.qkv(x)  # [rows, 1, heads * dim], a fresh tensor: rotated in place
            ops.rotate(qkv, heads, q_heads + kv_heads, cos, sin)
            qkv = qkv.view(rows, 1, heads, dim).transpose(1, 2)
            query, key, value = qkv[:, :q_heads], qkv[:, q_heads : q_heads + kv_heads], qkv[:, q_heads + kv_heads :]
            out = attend(index, query, key, value)
            out = out.reshape(rows, q_heads, 1, dim).transpose(1, 2).reshape(rows, 1, q_heads * dim)
            x = ops.rms_norm(hidden, layer.o_proj(out), layer.norm_post, layer.eps_post)
            pending = layer.down_proj(ops.silu_mul(layer.gate_up(x)))
        hidden = ops.rms_norm(hidden, pending, self.norm.weight, float(self.norm.variance_epsilon))
        return self.lm_head(hidden[:, -1, :])


class _TorchOps:
    """The kernel's fused elementwise operations (:attr:`LlamaDecoder.fused`) in torch's operators, as
    transformers computes them, operation for operation: what fp32 weights' steps take, and any step where the
    kernel is not built."""

    @staticmethod
    def rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``x += delta`` (in place) where given, then ``LlamaRMSNorm`` of ``x``."""
        if delta is not None:
            x.add_(delta)
        return _rms_norm(x, weight, eps)

    @staticmethod
    def rotate(x: torch.Tensor, heads: int, rotated: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """The rotary embedding of the first ``rotated`` of each row's ``heads`` heads of ``x``, in place, with the
        rotation's sign folded into the sine (``rotate_half(x) * sin == roll(x, d/2) * signed_sin``, exactly)."""
        rows, dim = cos.shape
        half = dim // 2
        part = x.view(rows, heads, dim)[:, :rotated]
        signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)[:, None]
        part.copy_(part * cos[:, None] + part.roll(half, dims=-1) * signed_sin)

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)  # gate and up: intermediate_size each
        return nn.functional.silu(gate) * up


def llama_decoder(model: Any) -> LlamaDecoder | None:
    """A :class:`LlamaDecoder` for ``model``, or ``None`` where the model is not one it computes exactly.

    It must be a ``LlamaForCausalLM`` with SDPA attention (or SDPA beside the prompts' kernel,
    ``prefill.PROMPT_ATTENTION``), fp32 hidden states, SiLU MLPs, RMS norms, and layers, attention,
    MLPs and rotary embedding of transformers' own classes, without module hooks
    (offloading, adapters) on its layers. The engine never installs hooks; a library that replaces a
    module's ``forward`` instead of hooking it is not detected.
    """
    from transformers.models.llama import modeling_llama as llama

    if type(model) is not llama.LlamaForCausalLM:
        return None
    config = model.config
    if config._attn_implementation not in ("sdpa", PROMPT_ATTENTION) or config.hidden_act != "silu":
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
