"""fp32 linear layers on the CPU through oneDNN: the inference engine's and the learner's matrix products.

torch's CPU ``F.linear`` for fp32 is MKL's sgemm. On the project's AMD EPYC VM (AVX-512, 2 cores)
it reaches ~10 GB/s of weights at a decode step's few rows and ~170 GFLOP/s at a training
micro-batch's 2,048; oneDNN's inner product (``torch.ops.mkldnn._linear_pointwise``, what
Inductor's CPU freezing calls) computes the same fp32 products 2-4x as fast at a few rows and 1.5-2x
at training sizes, differing only by fp32 rounding (~1e-6; ``bench/kernel_bench.py`` measures it).

- :func:`pack` and :func:`packed_linear`: weights reordered once into oneDNN's blocked layout, for a
  server that multiplies the same weights every pass (``services.inference.quant.Fp32Linear``).
- :func:`linear`: ``F.linear`` with autograd, its forward and both gradients oneDNN products of the
  plain weights (nothing packed: a learner's weights change every step); ``F.linear`` itself wherever
  oneDNN does not apply (not fp32 on the CPU, autocast on, or a torch without oneDNN).
- :func:`use_onednn_linears`: every ``nn.Linear`` of a model multiplies with :func:`linear` (same
  parameters, same state dict).
- :func:`packs_bf16`: whether oneDNN packs bf16 weights on this CPU at all.
- :func:`native_bf16`: whether the CPU multiplies bf16 natively, where the learner and the warm
  start's SFT train with bf16 products by default in the embedded run (``cpu_bf16``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

#: The row count :func:`pack` lays weights out for (oneDNN picks the blocked layout by it). Weights
#: packed for 4 rows served 1 to 512 rows as fast as ones packed for each count (AMD EPYC VM).
PACK_ROWS = 4


@functools.cache
def available() -> bool:
    """Whether this torch has oneDNN's fp32 inner product and weight packing for the CPU."""
    ops = torch.ops.mkldnn
    return bool(
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


@functools.cache
def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX-512 BF16 or AMX) through oneDNN.

    There a bf16 product takes about half an fp32 one's time (a training step of the default model
    ~1.8x as fast on the AMD EPYC VM); elsewhere bf16 is converted on the way and gains little.
    """
    cpu = torch.cpu
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return available() and any(bool(getattr(cpu, check, lambda: False)()) for check in checks)


@functools.cache
def packs_bf16() -> bool:
    """Whether oneDNN packs bf16 weights on this CPU (:func:`pack` with bf16 needs AVX-512 BW/VL/DQ or
    AVX-NE-CONVERT; on an AVX2-only CPU it raises)."""
    if not available():
        return False
    try:
        pack(torch.zeros(8, 8), torch.bfloat16)
    except RuntimeError:
        return False
    return True


def _product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``, ``weight`` ``[out, in]`` plain or packed by :func:`pack`."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")


def pack(weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``weight`` (``[out, in]``) in ``dtype`` (fp32 or bf16), reordered once for :func:`packed_linear`.

    Returns an opaque oneDNN tensor; :func:`packed_linear` multiplies activations of the same dtype by it.
    """
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(dtype).contiguous(), PACK_ROWS)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` by the weights :func:`pack` made of ``weight``; no autograd."""
    return _product(x, packed, None if bias is None else bias.detach())


def served_linear(
    x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a server: by ``packed`` (:func:`pack` of ``weight``, or ``None``)
    in a pass without autograd on fp32 activations, by ``F.linear`` otherwise."""
    if packed is None or torch.is_grad_enabled() or x.dtype != torch.float32:
        return nn.functional.linear(x, weight, bias)
    return packed_linear(x, packed, bias)


def _applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and weight.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and not torch.is_autocast_enabled("cpu")
        and available()
    )


class _Linear(torch.autograd.Function):
    """``F.linear`` whose forward, input gradient and weight gradient are oneDNN products."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _product(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        rows = grad.reshape(-1, grad.shape[-1])
        if ctx.needs_input_grad[0]:
            grad_x = _product(grad, weight.t().contiguous())  # grad @ weight
        if ctx.needs_input_grad[1]:
            # grad.T @ x: [out, rows] times [rows, in], as "x @ w.T" with w = x.T.
            grad_w = _product(rows.t(), x.reshape(-1, x.shape[-1]).t().contiguous())
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = rows.sum(dim=0)
        return grad_x, grad_w, grad_b


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, differentiable; oneDNN products for fp32 on the CPU (module docstring)."""
    if not _applies(x, weight):
        return nn.functional.linear(x, weight, bias)
    out: torch.Tensor = _Linear.apply(x, weight, bias)
    return out


class OneDnnLinear(nn.Linear):
    """An ``nn.Linear`` that multiplies with :func:`linear` (its parameters and state dict unchanged)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return linear(input, self.weight, self.bias)


def use_onednn_linears(model: nn.Module) -> int:
    """Make every plain ``nn.Linear`` of ``model`` a :class:`OneDnnLinear`, in place; return how many.

    Nothing changes where oneDNN is unavailable (0 returned); per call, :func:`linear` still falls
    back to ``F.linear`` for anything but fp32 on the CPU.
    """
    if not available():
        return 0
    changed = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = OneDnnLinear
            changed += 1
    return changed
