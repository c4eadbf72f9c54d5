"""Int8 weights for decoding: the served model's linear layers read a quarter of fp32's bytes per token.

Decoding one token per sequence is bound by reading the weights (every weight once per step; the
default model's fp32 weights are 538 MB a token), not by arithmetic. :func:`quantize_for_decode`
replaces every ``nn.Linear`` of a served model with an :class:`Int8Linear`: symmetric per-output-row
int8 weights with one scale per row (``scale = max |w| / 127``), multiplied by torch's CPU
weight-only int8 kernel (``aten._weight_int8pack_mm``: bf16 activations, fp32 accumulation, bf16
out) in the engine's decode steps (inside :func:`decode_step`). Prefills are compute bound, where
fp32 GEMM is faster; they use the dequantized weights (``int8 × scale`` in fp32), the same values,
so prefill and decode serve one model. The choice follows the pass, not its shape: a one-token
prefill after a radix-cache hit computes what a full prefill of the same prompt computes.

What it costs in exactness: logprobs move from the fp32 learner's by the int8 rounding of the
weights and the bf16 rounding of the activations and logits (``bench/inference_bench.py`` reports
the size). The learner recomputes its own logprobs and corrects the difference with truncated
importance sampling (:mod:`services.learner.core.losses`), which exists for exactly this; fp32
weights (the engine's default) stay within 1e-4 of a float32 learner.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TypeVar, get_args

import torch
from torch import nn

from services.inference.settings import WeightsMode

_INT8_MAX = 127.0
_Model = TypeVar("_Model", bound=nn.Module)
_pass = threading.local()  # each engine computes on its own scheduler thread


@contextlib.contextmanager
def decode_step() -> Iterator[None]:
    """Within it, this thread's :class:`Int8Linear` layers multiply with the int8 kernel (a decode step)."""
    _pass.decoding = True
    try:
        yield
    finally:
        _pass.decoding = False


class QuantizationUnavailable(RuntimeError):
    """This torch build has no weight-only int8 kernel for the CPU."""


def int8_kernel_available() -> bool:
    """Whether this torch has ``aten._weight_int8pack_mm`` (the CPU weight-only int8 matmul)."""
    return hasattr(torch.ops.aten, "_weight_int8pack_mm")


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row: ``(int8 [out, in], bf16 scales [out])``; ``q × scale ≈ weight``.

    The scale is rounded to bf16 (the kernel's type) *before* rounding the weights, so the
    dequantized matrix is exactly what the kernel multiplies by.
    """
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1).clamp(min=1e-12) / _INT8_MAX).to(torch.bfloat16)
    q = torch.round(w / scales.float()[:, None]).clamp(-_INT8_MAX, _INT8_MAX).to(torch.int8)
    return q.contiguous(), scales


class Int8Linear(nn.Module):
    """A linear layer served from int8 weights (see the module docstring).

    Attributes:
        qweight: ``[out, in]`` int8 weights.
        scales: ``[out]`` bf16 per-row scales.
        weight: the dequantized ``[out, in]`` fp32 weights, for multi-token passes.
        bias: the original bias (fp32) or ``None``.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q, scales = quantize_rows(linear.weight)
        self.qweight = q
        self.scales = scales
        self.weight = nn.Parameter((q.float() * scales.float()[:, None]).contiguous(), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not getattr(_pass, "decoding", False):
            return nn.functional.linear(x, self.weight, self.bias)
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)
        y = torch.ops.aten._weight_int8pack_mm(rows, self.qweight, self.scales)
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def quantize_for_decode(model: _Model) -> _Model:
    """Replace every ``nn.Linear`` of ``model`` with an :class:`Int8Linear`, in place; returns ``model``.

    Raises:
        QuantizationUnavailable: This torch has no weight-only int8 CPU kernel.
    """
    if not int8_kernel_available():
        raise QuantizationUnavailable(
            f"torch {torch.__version__} has no aten._weight_int8pack_mm; serve float32 weights instead"
        )
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, Int8Linear(child))
    return model


def prepare_weights(model: _Model, mode: WeightsMode) -> _Model:
    """``model`` as served in ``mode``: unchanged for ``float32``, :func:`quantize_for_decode` for ``int8``."""
    if mode == "int8":
        return quantize_for_decode(model)
    if mode != "float32":
        raise ValueError(f"unknown weights mode {mode!r}; choose one of {', '.join(get_args(WeightsMode))}")
    return model
