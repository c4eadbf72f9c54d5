"""What the learner and the warm start's SFT share about a training step's arithmetic.

- :func:`autocast`: bf16 products where a run asks for them (the learner's ``bf16`` on a GPU, its and
  the warm start's ``cpu_bf16`` on the CPU), fp32 everywhere else; weights, gradients and the
  optimizer's moments stay fp32 either way.
- :func:`adamw`: AdamW, fused where torch has a fused kernel for the parameters.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn


def autocast(device: torch.device, bf16: bool) -> contextlib.AbstractContextManager[Any]:
    """A pass's products in bf16 on ``device`` where ``bf16``, in fp32 otherwise (losses are taken in fp32)."""
    if bf16 and device.type in ("cpu", "cuda"):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def adamw(params: Iterable[nn.Parameter], **kwargs: Any) -> torch.optim.AdamW:
    """``torch.optim.AdamW(params, **kwargs)``, fused where torch has a fused kernel for ``params``
    (several times faster on the CPU), ``foreach`` otherwise."""
    params = list(params)
    try:
        return torch.optim.AdamW(params, fused=True, **kwargs)
    except (RuntimeError, ValueError, TypeError):  # no fused kernel for these parameters here
        return torch.optim.AdamW(params, foreach=True, **kwargs)
