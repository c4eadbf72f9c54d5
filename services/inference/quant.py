"""Bf16, int8 and int4 weights for decoding: the served model's linear layers read a half, a quarter or an eighth
of fp32's bytes.

Decoding one token per sequence is bound by reading the weights (every weight once per step; the default
model's fp32 weights are 538 MB a token), not by arithmetic. :func:`prepare_weights` replaces every
``nn.Linear`` of a served model with an :class:`Int8Linear`: symmetric per-output-row int8 weights with one
scale per row (``scale = max |w| / 127``), multiplied in the engine's decode steps (inside
:func:`decode_step`) by the engine's own kernel where it builds (below), else by torch's CPU weight-only int8
kernel (``aten._weight_int8pack_mm``: bf16 activations, fp32 accumulation, bf16 out). Prefills are compute
bound, where fp32 GEMM is faster; they use the dequantized weights (``int8 × scale`` in fp32), the same
values, so prefill and decode serve one model. The choice follows the pass, not its shape: a one-token prefill
after a radix-cache hit computes what a full prefill of the same prompt computes.

**Bf16** (``weights: bf16``): every linear layer becomes a :class:`Bf16Linear`, its weights rounded
to bf16 once; decode steps multiply them with bf16 activations (fp32 accumulation; prepacked for
oneDNN where torch has it, ``bench/kernel_bench.py``'s ``bf16_packed``), or through the engine's own
kernel (below: bf16 activations too where the CPU multiplies bf16 natively, fp32 ones elsewhere). Prefills do
the same where the
CPU multiplies bf16 natively (:func:`spade.cpu_linear.native_bf16`: 1.6-1.8x fp32's products at 64-900
rows on the AMD EPYC VM), and elsewhere use the same rounded weights in fp32 (prepacked too). Half of
fp32's bytes, and no quantization kernel: its speed depends least on the CPU (``bench/kernel_bench.py``: about 2× fp32's
matrix products at 1, 4 and 16 rows on an AVX-512 VM, where int8's kernel is 4.9× at one row but
1.55× at 16), and its rounding (8 bits of mantissa per weight) is finer than int8's per-row step.

**Int4** (``weights: int4``): every linear layer but the LM head becomes an :class:`Int4Linear`:
4-bit codes in groups of 32 inputs with a scale and a minimum per group (llama.cpp's Q4_1 layout,
the one the default model's GGUF stores its layer matrices in, so the base model's weights quantize
back onto their own grid), multiplied by torch's CPU int4 kernel (``aten._weight_int4pack_mm_for_cpu``,
bf16 scales and zeros). The LM head stays an :class:`Int8Linear` (the GGUF keeps it at 8 bits too:
at 4 bits it moved logprobs several times more than all the other layers together).

**The engine's own kernel** (:mod:`services.inference.rows`, wherever it builds: AVX2 or AVX-512)
multiplies int8 decode steps, and bf16 ones on a CPU without AVX-512 (AVX2 only): fp32 activations
times the weights widened to fp32 in registers, fp32 sums. torch has nothing faster for them there
(oneDNN packs no bf16 weights on an AVX2 CPU, and the int8 kernel rounds activations to bf16), and the
products are then the fp32 products of the rounded weights to fp32 rounding, a row's bits not
depending on its batch. Where oneDNN packs bf16 too (AVX-512), a bf16 decode step of a few rows, or of
more rows with a long context, takes the kernel (:func:`bf16_rows_kernel_takes`), a larger one, a prefill and
every batch-invariant step (``decode_step(invariant=True)``: one product at every row count) oneDNN's. Where
that CPU multiplies bf16 natively (AVX-512 BF16, :func:`services.inference.rows.multiplies_bf16`) the
kernel's bf16 products round the activations to bf16 and multiply them in pairs (``VDPBF16PS``), as oneDNN's
and the prefills' do, so every bf16 product there has bf16 activations.

In the int8 and int4 modes, and in bf16 on a CPU without native bf16, prefills (passes without autograd
outside a decode step) multiply the dequantized fp32 weights prepacked for oneDNN (:mod:`spade.cpu_linear`),
another fp32 copy's memory.

**Float32** (``weights: float32``, the default): the checkpoint's weights as loaded, each linear layer
an :class:`Fp32Linear` that also keeps them prepacked in oneDNN's blocked layout and, without
autograd (every engine pass), multiplies the packed copy (``torch.ops.mkldnn._linear_pointwise``,
the kernel Inductor's CPU freezing packs linear layers for). torch's own fp32 product (``F.linear``,
MKL's sgemm on ``[out, in]`` weights) reads a few rows' weights at ~10 GB/s on this CPU, and 2 or 3
rows cost more than 4; the packed product reads them at up to ~55 GB/s (AVX-512 VM, 2 threads,
weights streamed from memory, ms for the model's 211 matrices: 32.4 → 14.8 at one row, 50.1 → 12.7
at 4, 66.3 → 20.2 at 16; prefill-sized products of 512 rows 1.8-2.3x). The products differ from
``F.linear``'s by fp32 rounding (~1e-6), as any change of batch shape does. The packed copies take
the weights' size again (538 MB for the default model); a torch without oneDNN serves ``F.linear``.

What it costs in exactness: logprobs move from the fp32 learner's by the rounding of the weights
and the bf16 rounding of the activations and logits (``bench/inference_bench.py`` reports
the size). The learner recomputes its own logprobs and corrects the difference with truncated
importance sampling (:mod:`services.learner.core.losses`), which exists for exactly this; fp32
weights (the engine's default) stay within 1e-4 of a float32 learner.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar, get_args

import torch
from torch import nn

from services.inference import rows as rows_kernel
from services.inference.settings import WeightsMode
from spade import cpu_linear

_INT8_MAX = 127.0
#: Inputs per int4 group (Q4_1's block).
INT4_GROUP = 32
_Model = TypeVar("_Model", bound=nn.Module)
_pass = threading.local()  # each engine computes on its own scheduler thread


@contextlib.contextmanager
def decode_step(*, invariant: bool = False, positions: int = 0) -> Iterator[None]:
    """Within it, this thread's quantized layers multiply with their kernels (a decode step); nests.

    ``invariant``: a batch-invariant step (:meth:`services.inference.llama_decode.LlamaDecoder.apart` and its
    probe), in which each layer takes one kind of product whatever the rows' count, so that a row's bits do
    not depend on how many rows share its pass (a bf16 layer's choice, :func:`bf16_rows_kernel_takes`, is
    then oneDNN's wherever it packs bf16). A step nested in an invariant one stays invariant.
    ``positions``: how many positions the step attends to, where the caller knows (0: unknown, or the outer
    step's), for that choice.
    """
    outer = (getattr(_pass, "decoding", False), getattr(_pass, "invariant", False), getattr(_pass, "positions", 0))
    _pass.decoding, _pass.invariant, _pass.positions = True, invariant or outer[1], positions or outer[2]
    try:
        yield
    finally:
        _pass.decoding, _pass.invariant, _pass.positions = outer


def bf16_rows_kernel_takes(rows: int) -> bool:
    """Beside oneDNN's packed bf16 product (AVX-512), whether a bf16 product of ``rows`` rows goes through the
    engine's kernel instead: in a decode step that is not batch-invariant, where
    :func:`services.inference.rows.bf16_kernel_wins` for its rows and positions. Prefills keep oneDNN's
    whatever their length, so a prefill computes what it computes after a radix-cache hit. (Where oneDNN packs
    no bf16, every bf16 decode product takes the kernel and this is not asked.)"""
    if not getattr(_pass, "decoding", False) or getattr(_pass, "invariant", False):
        return False
    return rows_kernel.bf16_kernel_wins(rows, getattr(_pass, "positions", 0))


def _rows_of(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1]


def through_kernel(x: torch.Tensor, kernel: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``kernel`` (``[rows, in]`` bf16 activations to ``[rows, out]`` bf16) applied to ``x`` (``[..., in]``),
    returned in ``x``'s dtype and leading shape: how every quantized decode product is taken."""
    y = kernel(x.reshape(-1, x.shape[-1]).to(torch.bfloat16))
    return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])


class QuantizationUnavailable(RuntimeError):
    """This torch build has no weight-only kernel of the asked width for the CPU."""


#: The CPU kernel each quantized mode multiplies with.
KERNELS = {"int8": "_weight_int8pack_mm", "int4": "_weight_int4pack_mm_for_cpu"}


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row: ``(int8 [out, in], bf16 scales [out])``; ``q × scale ≈ weight``.

    The scale is rounded to bf16 (the kernel's type) *before* rounding the weights, so the
    dequantized matrix is exactly what the kernel multiplies by.
    """
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1).clamp(min=1e-12) / _INT8_MAX).to(torch.bfloat16)
    q = torch.round(w / scales.float()[:, None]).clamp(-_INT8_MAX, _INT8_MAX).to(torch.int8)
    return q.contiguous(), scales


class _QuantizedLinear(nn.Module):
    """A linear layer whose decode steps multiply quantized weights (:meth:`_kernel`) and prefills the
    dequantized ones (``weight``, fp32: the same values; ``prefill_packed``, prepacked for oneDNN as
    :class:`Fp32Linear`'s, where torch has it, in passes without autograd)."""

    weight: nn.Parameter
    bias: nn.Parameter | None

    #: Whether prefills multiply with :meth:`_kernel` too (passes without autograd), not the fp32 weights.
    kernel_prefills = False

    def __init__(self, linear: nn.Linear, dequantized: torch.Tensor) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = nn.Parameter(dequantized.contiguous(), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float(), requires_grad=False)
        fp32_prefills = cpu_linear.available() and not self.kernel_prefills
        self.prefill_packed = cpu_linear.pack(dequantized) if fp32_prefills else None

    def _kernel(self, rows: torch.Tensor) -> torch.Tensor:
        """``[rows, in]`` bf16 activations times the quantized weights: ``[rows, out]`` bf16."""
        raise NotImplementedError

    def decode_bytes(self) -> int:
        """Bytes a decode step reads from this layer (its codes, scales and bias)."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = getattr(_pass, "decoding", False) or (self.kernel_prefills and not torch.is_grad_enabled())
        if not kernel:
            return cpu_linear.served_linear(x, self.weight, self.prefill_packed, self.bias)
        y = self._decode(x)
        return y if self.bias is None else y + self.bias

    def _decode(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (``[..., in]``) times the quantized weights, in ``x``'s dtype: a decode step's product."""
        return through_kernel(x, self._kernel)

    def _bias_bytes(self) -> int:
        return 0 if self.bias is None else self.bias.numel() * self.bias.element_size()


class Fp32Linear(nn.Module):
    """A linear layer served from its own fp32 weights, prepacked once in oneDNN's blocked layout.

    Without autograd (the engine's passes run under ``torch.inference_mode``) every product, prefill
    or decode step of any size, multiplies the packed copy (``torch.ops.mkldnn._linear_pointwise``);
    with autograd it is ``F.linear`` on the layer's own weights.

    Attributes:
        weight: the layer's own ``[out, in]`` parameter (still tied where it was), in the state dict.
        packed: the same values in oneDNN's layout (:func:`spade.cpu_linear.pack`; not in the state dict).
        bias: the layer's own bias or ``None``.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.packed = cpu_linear.pack(linear.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_linear.served_linear(x, self.weight, self.packed, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, float32 packed"


class Int8Linear(_QuantizedLinear):
    """A linear layer served from int8 weights, one scale per output row (see the module docstring).

    Attributes:
        qweight: ``[out, in]`` int8 weights, for torch's int8 product; ``None`` where decode steps multiply
            through the engine's kernel (:mod:`.rows`: fp32 activations times the widened codes, wherever it
            builds).
        rows_qweight: the same codes in that kernel's blocked layout (:func:`.rows.pack`) where it serves,
            else ``None``.
        scales: ``[out]`` bf16 per-row scales.
        rows_scales: the same in fp32 where the kernel serves (its type), else ``None``.
        weight: the dequantized ``[out, in]`` fp32 weights, for prefills.
        bias: the original bias (fp32) or ``None``.
    """

    def __init__(self, linear: nn.Linear) -> None:
        q, scales = quantize_rows(linear.weight)
        super().__init__(linear, q.float() * scales.float()[:, None])
        rows = _use_rows_kernel(self.in_features, self.out_features)
        self.qweight = None if rows else q
        self.rows_qweight = rows_kernel.pack(q) if rows else None
        self.scales = scales
        self.rows_scales = scales.float() if rows else None

    def _kernel(self, rows: torch.Tensor) -> torch.Tensor:
        assert self.qweight is not None
        return _int8_product(rows, self.qweight, self.scales)

    def _decode(self, x: torch.Tensor) -> torch.Tensor:
        if self.rows_qweight is None or self.rows_scales is None:
            return super()._decode(x)
        return rows_kernel.int8_rows(x, self.rows_qweight, self.rows_scales).to(x.dtype)

    def decode_bytes(self) -> int:
        codes = self.in_features * self.out_features  # one byte a weight
        return codes + self.scales.numel() * self.scales.element_size() + self._bias_bytes()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


class Bf16Linear(_QuantizedLinear):
    """A linear layer served from its weights rounded to bf16 (see the module docstring).

    Attributes:
        packed16: ``[out, in]`` bf16 weights prepacked for oneDNN where it packs bf16 (AVX-512), what
            the decode steps :func:`bf16_rows_kernel_takes` leaves to it and batch-invariant ones multiply,
            and prefills too where the CPU multiplies bf16 natively (``kernel_prefills``); else ``None``.
        rows: whether decode steps multiply through the engine's kernel (:mod:`.rows`: fp32 activations, or
            bf16 ones where :func:`.rows.multiplies_bf16`): every one, or those :func:`bf16_rows_kernel_takes`
            gives it where ``packed16`` serves too.
        rows16: the bf16 weights in that kernel's blocked layout (:func:`.rows.pack`) where it serves,
            else ``None``.
        weight16: the same values as a plain ``[out, in]`` tensor, for ``F.linear``, where neither
            ``packed16`` nor ``rows16`` serves.
        weight: the same values in fp32 (``[out, in]``), for prefills elsewhere and for autograd.
        bias: the original bias (fp32) or ``None``.
    """

    def __init__(self, linear: nn.Linear) -> None:
        rounded = linear.weight.detach().to(torch.bfloat16).contiguous()
        # Where the CPU multiplies bf16 natively, prefills take the decode steps' product too (1.6-1.8x
        # fp32's at prefill sizes on the AMD EPYC VM); elsewhere bf16 is converted on the way and fp32 wins.
        self.kernel_prefills = cpu_linear.native_bf16()
        super().__init__(linear, rounded.float())
        self.rows = _use_rows_kernel(self.in_features, self.out_features)
        packing = cpu_linear.packs_bf16()
        self.packed16 = cpu_linear.pack(rounded, torch.bfloat16) if packing else None
        self.rows16 = rows_kernel.pack(rounded) if self.rows else None
        self.weight16 = None if packing or self.rows else rounded

    def _kernel(self, rows: torch.Tensor) -> torch.Tensor:
        if self.packed16 is not None:
            return cpu_linear.packed_linear(rows, self.packed16)
        assert self.weight16 is not None
        return nn.functional.linear(rows, self.weight16)

    def _decode(self, x: torch.Tensor) -> torch.Tensor:
        if self.rows16 is None or (self.packed16 is not None and not bf16_rows_kernel_takes(_rows_of(x))):
            return super()._decode(x)
        return rows_kernel.bf16_rows(x, self.rows16).to(x.dtype)

    def decode_bytes(self) -> int:
        return self.weight.numel() * 2 + self._bias_bytes()  # bf16: two bytes a weight

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bf16"


def quantize_groups(weight: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """4-bit codes per group of ``group`` inputs with a scale and a minimum (Q4_1's layout).

    Returns ``(codes, scales_and_zeros)``: int32 codes in ``[0, 15]`` ``[out, in]`` and bf16
    ``[in / group, out, 2]`` of (scale, zero), the kernel's layout, with ``code × scale + minimum =
    (code − 8) × scale + zero``. Scale and zero are rounded to bf16 before the codes are chosen, so
    :func:`dequantize_groups` gives exactly what the kernel multiplies by.
    """
    out_features, in_features = weight.shape
    w = weight.detach().float().view(out_features, in_features // group, group)
    low, high = w.amin(dim=-1), w.amax(dim=-1)
    scales = ((high - low) / 15.0).clamp(min=1e-12).to(torch.bfloat16)
    zeros = (low + 8.0 * scales.float()).to(torch.bfloat16)
    minimum = zeros.float() - 8.0 * scales.float()
    codes = torch.round((w - minimum[..., None]) / scales.float()[..., None]).clamp(0, 15)
    packed_scales = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()
    return codes.view(out_features, in_features).to(torch.int32), packed_scales


def dequantize_groups(codes: torch.Tensor, scales_and_zeros: torch.Tensor, group: int = INT4_GROUP) -> torch.Tensor:
    """The fp32 weights that ``codes`` and ``scales_and_zeros`` (:func:`quantize_groups`) stand for."""
    out_features, in_features = codes.shape
    scales = scales_and_zeros[..., 0].float().t()[..., None]  # [out, in / group, 1]
    zeros = scales_and_zeros[..., 1].float().t()[..., None]
    grouped = codes.float().view(out_features, in_features // group, group)
    return ((grouped - 8.0) * scales + zeros).view(out_features, in_features)


class Int4Linear(_QuantizedLinear):
    """A linear layer served from 4-bit weights in groups of :data:`INT4_GROUP` (see the module docstring).

    Attributes:
        packed: the kernel's packed codes.
        scales_and_zeros: ``[in / 32, out, 2]`` bf16 scale and zero of each group.
        weight: the dequantized ``[out, in]`` fp32 weights, for prefills.
        bias: the original bias (fp32) or ``None``.
    """

    def __init__(self, linear: nn.Linear) -> None:
        codes, scales_and_zeros = quantize_groups(linear.weight)
        super().__init__(linear, dequantize_groups(codes, scales_and_zeros))
        self.scales_and_zeros = scales_and_zeros
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)

    def _kernel(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, INT4_GROUP, self.scales_and_zeros)

    def decode_bytes(self) -> int:
        tensors = (self.packed, self.scales_and_zeros)
        return sum(t.numel() * t.element_size() for t in tensors) + self._bias_bytes()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 groups of {INT4_GROUP}"


def prepare_weights(model: _Model, mode: WeightsMode) -> _Model:
    """``model`` as served in ``mode``, its linear layers replaced in place; returns ``model``.

    ``float32``: every linear layer an :class:`Fp32Linear` (the same weights, prepacked too) where
    torch has oneDNN (:func:`spade.cpu_linear.available`); unchanged otherwise.
    ``bf16``: every linear layer a :class:`Bf16Linear`. ``int8``: every linear
    layer an :class:`Int8Linear`. ``int4``: every one an
    :class:`Int4Linear`, but the LM head (the model's output embeddings) and any layer whose inputs are
    not whole groups of :data:`INT4_GROUP`, which become :class:`Int8Linear`.

    Raises:
        ValueError: An unknown mode.
        QuantizationUnavailable: This torch has no weight-only CPU kernel the mode needs.
    """
    if mode == "float32":
        if cpu_linear.available():
            _replace_linears(model, Fp32Linear)
        return model
    if mode == "bf16":
        _replace_linears(model, Bf16Linear)
        return model
    if mode not in KERNELS:
        raise ValueError(f"unknown weights mode {mode!r}; choose one of {', '.join(get_args(WeightsMode))}")
    for kernel in {KERNELS["int8"], KERNELS[mode]}:
        if not hasattr(torch.ops.aten, kernel):
            raise QuantizationUnavailable(
                f"torch {torch.__version__} has no aten.{kernel}; serve float32 (or int8) weights instead"
            )
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None

    def served(child: nn.Linear) -> _QuantizedLinear:
        four = mode == "int4" and child is not head and child.in_features % INT4_GROUP == 0
        return Int4Linear(child) if four else Int8Linear(child)

    _replace_linears(model, served)
    return model


def _int8_product(rows: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``[rows, in]`` bf16 activations times int8 weights with one bf16 scale per row: ``[rows, out]`` bf16."""
    return torch.ops.aten._weight_int8pack_mm(rows, qweight, scales)


def stacked_product(layers: Sequence[Any]) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """One decode-step product for served layers that read the same input: their outputs side by side.

    Their weights are stacked (``[Σ out, in]``) once, in the layers' own format and multiplied as a
    layer of that format multiplies in a decode step: fp32 (:class:`Fp32Linear`) and bf16
    (:class:`Bf16Linear`, its weights already rounded) packed for oneDNN, int8 (:class:`Int8Linear`)
    codes and scales, and the engine's kernel's blocked weights where the layers have them (bf16 ``rows16``,
    int8 ``rows_qweight``: stacked once, each layer's own then a view of its part). ``None`` for layers of
    mixed or other kinds (int4, whose packed layout is the kernel's own), some with the kernel's weights
    and some without, with a bias, or where torch has no oneDNN.
    """
    kind = type(layers[0])
    if not cpu_linear.available() or any(type(m) is not kind or getattr(m, "bias", None) is not None for m in layers):
        return None
    if kind is Int8Linear:
        scales = torch.cat([m.scales for m in layers])
        if all(m.rows_qweight is not None for m in layers):  # blocked codes stack as [out, in] ones do
            rows_qweight = _stack_shared(layers, "rows_qweight")
            rows_scales = scales.float()
            return lambda x: rows_kernel.int8_rows(x, rows_qweight, rows_scales).to(x.dtype)
        if any(m.qweight is None for m in layers):
            return None
        qweight = torch.cat([m.qweight for m in layers])
        return lambda x: through_kernel(x, lambda rows: _int8_product(rows, qweight, scales))
    if kind not in (Fp32Linear, Bf16Linear):
        return None
    weights = torch.cat([m.weight.detach() for m in layers])
    if kind is Fp32Linear:
        packed = cpu_linear.pack(weights)
        return lambda x: cpu_linear.packed_linear(x, packed)
    kernel_weights = [m.rows16 is not None for m in layers]
    if any(kernel_weights) and not all(kernel_weights):  # each layer chooses its own product by rows
        return None
    packed16 = cpu_linear.pack(weights, torch.bfloat16) if cpu_linear.packs_bf16() else None
    if all(kernel_weights):
        rows16 = _stack_shared(layers, "rows16")
        if packed16 is None:
            return lambda x: rows_kernel.bf16_rows(x, rows16).to(x.dtype)
        return lambda x: (
            rows_kernel.bf16_rows(x, rows16).to(x.dtype)
            if bf16_rows_kernel_takes(_rows_of(x))
            else through_kernel(x, lambda rows: cpu_linear.packed_linear(rows, packed16))
        )
    if packed16 is None:
        return None
    return lambda x: through_kernel(x, lambda rows: cpu_linear.packed_linear(rows, packed16))


def _stack_shared(layers: Sequence[Any], name: str) -> torch.Tensor:
    """The layers' blocked weights ``name`` stacked (they stack along dim 0 as ``[out, in]`` ones do), each
    layer's own attribute then a view of its part: one copy serves the stacked product and the layers."""
    stacked = torch.cat([getattr(m, name) for m in layers])
    start = 0
    for m in layers:
        blocks = getattr(m, name).shape[0]
        setattr(m, name, stacked[start : start + blocks])
        start += blocks
    return stacked


def decodes_through_rows_kernel(layer: nn.Module) -> bool:
    """Whether ``layer``'s decode products go through the engine's own kernel: every one, or for a bf16 layer
    beside oneDNN's product those :func:`bf16_rows_kernel_takes` gives it."""
    if isinstance(layer, Bf16Linear):
        return layer.rows16 is not None
    return isinstance(layer, Int8Linear) and layer.rows_qweight is not None


def _use_rows_kernel(in_features: int, out_features: int) -> bool:
    """Whether a bf16 or int8 layer of this shape keeps the engine's own kernel's weights and decodes through
    it (:func:`services.inference.rows.decodes_here`: wherever it builds; bf16 beside oneDNN in steps of a
    few rows, :func:`bf16_rows_kernel_takes`)."""
    return rows_kernel.fits(in_features, out_features) and rows_kernel.decodes_here()


def _replace_linears(model: nn.Module, served: Callable[[nn.Linear], nn.Module]) -> None:
    """Replace every ``nn.Linear`` of ``model``, in place, with ``served(layer)``."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, served(child))
