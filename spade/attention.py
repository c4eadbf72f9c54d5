"""Causal attention on the CPU, faster than torch's SDPA: the inference engine's prefills and the learner's passes.

On the project's AMD EPYC VMs torch's CPU SDPA (its flash kernel) attends at ~100 GFLOP/s on SmolLM2's 64-dim
heads while the same model's products reach ~800: attention was half of a long prompt's prefill and over a
third of a learner step on the designer's long samples. ``attention_kernel.cpp`` (beside this module) computes
the same attention at ~250-300 GFLOP/s in fp32 on AVX-512 (``bench/attention_bench.py``).

:func:`causal_attention` takes queries ``[H, n, D]`` and keys and values ``[KVH, T, D]`` (grouped-query
attention) where query ``i`` sees keys ``[0, T - n + i]``: the keys before the queries are a prefix every query
sees (a cached prompt; the learner's shared prefix), the rest causally. It is differentiable (the kernel's own
backward, from the forward's log-sum-exps) and computes in fp32 whatever its inputs (bf16 under autocast is
widened exactly), returning the queries' dtype; SDPA under bf16 autocast rounds its probabilities to bf16,
so the kernel's results are the closer to exact. A query's result does not depend on the queries beside it.

Where the kernel cannot serve (no AVX-512, no compiler, ``SPADE_ATTENTION_KERNEL=0``, a head dim not a
multiple of 16, a tensor off the CPU) :func:`applies` is false and callers keep SDPA;
:func:`unavailable_reason` says why.
"""

from __future__ import annotations

import functools
import logging
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from spade import native
from spade.config import turned_off

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("attention_kernel.cpp")
SWITCH = "SPADE_ATTENTION_KERNEL"
"""Set to ``0`` to keep torch's SDPA everywhere."""
DIM_MULTIPLE = 16
"""The head dim must be a multiple of this (one AVX-512 register of fp32)."""

_reason: list[str] = []
_building = threading.Lock()


@functools.cache
def kernel() -> ModuleType | None:
    """The compiled module (``causal_forward``, ``causal_backward``), built on first use; ``None`` where unavailable."""
    with _building:
        return _load()


def _load() -> ModuleType | None:
    if turned_off(SWITCH):
        _reason.append(f"turned off by {SWITCH}")
        return None
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        _reason.append(f"the CPU's capability is {torch.backends.cpu.get_cpu_capability()}, not AVX-512")
        return None
    try:
        module = native.build(SOURCE, "spade_attention")
    except Exception as error:  # no compiler or ninja, a failed build: SDPA serves instead
        _reason.append(f"building {SOURCE.name} failed: {type(error).__name__}: {str(error)[-400:]}")
        logger.warning("attention kernel unavailable, SDPA attends instead: %s", _reason[-1])
        return None
    if not module.causal_supported():
        _reason.append("the CPU lacks AVX-512 F or DQ")
        return None
    _reason.clear()
    return module


def unavailable_reason() -> str | None:
    """Why :func:`kernel` is ``None`` (after it was called), else ``None``."""
    return _reason[-1] if _reason else None


def applies(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether :func:`causal_attention` can attend these (``[..., heads, length, dim]``; the kernel is built last):
    CPU tensors, one head dim for all three (a multiple of 16), keys and values shaped alike, query heads a
    multiple of the key/value heads, no more queries than keys."""
    return (
        query.device.type == key.device.type == value.device.type == "cpu"
        and query.is_floating_point()
        and key.shape == value.shape
        and query.dim() == key.dim() >= 3
        and query.shape[-1] == key.shape[-1]
        and query.shape[-1] % DIM_MULTIPLE == 0
        and key.shape[-3] > 0
        and query.shape[-3] > 0
        and query.shape[-3] % key.shape[-3] == 0
        and query.shape[-2] <= key.shape[-2]
        and kernel() is not None
    )


class _CausalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
        module = kernel()
        assert module is not None
        q, k, v = (x.detach().float().contiguous() for x in (query, key, value))
        out, lse = module.causal_forward(q, k, v, scale)
        if any(ctx.needs_input_grad[:3]):
            ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale = scale
        ctx.dtypes = (query.dtype, key.dtype, value.dtype)
        return out.to(query.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        module = kernel()
        assert module is not None
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = module.causal_backward(q, k, v, out, grad.float().contiguous(), lse, ctx.scale)
        dtypes = ctx.dtypes
        return dq.to(dtypes[0]), dk.to(dtypes[1]), dv.to(dtypes[2]), None


def causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """``softmax(scale * q k^T) v`` of queries ``[H, n, D]`` on keys and values ``[KVH, T, D]``, query ``i``
    seeing keys ``[0, T - n + i]``; ``[H, n, D]`` in the queries' dtype, differentiable.

    Raises:
        RuntimeError: Shapes the kernel refuses (the message says which), or no kernel (check :func:`applies`).
    """
    if kernel() is None:
        raise RuntimeError(f"the attention kernel is unavailable: {unavailable_reason()}")
    out: torch.Tensor = _CausalAttention.apply(query, key, value, float(scale))
    return out


if __name__ == "__main__":  # make install: build it now, not in the first run's first prefill
    logging.basicConfig(level=logging.INFO)
    built = kernel()
    print(f"attention kernel: {'built' if built is not None else 'unavailable: ' + str(unavailable_reason())}")
