"""Decode-step products of bf16 and int8 weights: the engine's own kernel.

A decode step multiplies a few rows of activations by every weight of the model, so it is bound by
how fast the weights stream from memory. On a CPU with AVX2 but no native bf16 (AMD EPYC Zen 3, for
one), torch has no product that reads bf16 or int8 weights faster than fp32 ones: oneDNN converts
bf16 on the way, and the weight-only int8 kernel multiplies bf16 activations. ``rows_kernel.cpp``
(beside this module) widens the weights to fp32 in registers and multiplies fp32 activations with
fused multiply-adds, so a step reads half (bf16) or a quarter (int8) of fp32's bytes and the
activations keep fp32's precision. On an AVX-512 CPU with native bf16 (AMD EPYC Zen 4) it reads a few
rows' weights faster than oneDNN's bf16 product and torch's int8 kernel too (1.6x at one row), so int8
decode steps take it at every row count and bf16 ones of a few rows, or of more rows with a long context
(:func:`bf16_kernel_wins`), beyond which oneDNN's native bf16 arithmetic wins. There its bf16 products
multiply natively too (:func:`multiplies_bf16`: the activations rounded to bf16, as oneDNN's are, two
products a lane with ``VDPBF16PS``), no longer bound by widening and fp32 arithmetic from a few rows on.
The weights are kept in the kernel's blocked layout (:func:`pack`), in which each block of 4 outputs streams
from memory in one sequential pass. The same extension attends a decode step's one query position to the fp32 KV cache
(:func:`decode_attention`), faster than SDPA on both CPUs.

Every output sums its products in one order whatever rows are beside it, so a row's result does not
depend on its batch (the batch-invariant mode's decode steps share passes through it,
:func:`services.inference.llama_decode.row_invariant_from` finds that).

The kernel is C++ compiled once per source and torch version (:func:`spade.native.build`, about
40 s with g++; ``make install`` builds it) into ``$SPADE_KERNEL_CACHE`` (default
``~/.cache/spade/kernels``). Where it cannot be built or loaded (no compiler, no AVX2, another
architecture) or ``SPADE_ROWS_KERNEL=0``, :func:`kernel` is ``None`` and the layers keep torch's
products; :func:`unavailable_reason` says why. :func:`decodes_here` is where the layers use it.
"""

from __future__ import annotations

import functools
import logging
import threading
from pathlib import Path
from types import ModuleType

import torch

from spade import cpu_linear, native
from spade.config import turned_off

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("rows_kernel.cpp")
#: Inputs of a product must be whole groups of this many (one AVX2 register of fp32).
INPUT_MULTIPLE = 8
#: Outputs of a product must be whole blocks of this many (the weights a tile widens per group of inputs).
BLOCK = 4
#: The attention's head dim must be a multiple of this (two AVX2 registers of fp32).
ATTENTION_DIM_MULTIPLE = 16
_reason: list[str] = []


_building = threading.Lock()


@functools.cache
def kernel() -> ModuleType | None:
    """The compiled kernel module (``bf16_rows``, ``int8_rows``, ``bf16_dot_rows`` and ``bf16_dot_supported``,
    ``decode_attention``), built on first use; ``None`` where unavailable."""
    with _building:  # one build a process (functools.cache does not hold back a second caller)
        return _load()


def _load() -> ModuleType | None:
    if turned_off("SPADE_ROWS_KERNEL"):
        _reason.append("turned off by SPADE_ROWS_KERNEL")
        return None
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        _reason.append(f"the CPU's capability is {capability}, not AVX2 or AVX-512")
        return None
    try:
        module = native.build(SOURCE, "spade_rows")
    except Exception as error:  # no compiler or ninja, a failed build: torch's products serve instead
        _reason.append(f"building {SOURCE.name} failed: {type(error).__name__}: {str(error)[-400:]}")
        logger.warning("rows kernel unavailable, decode steps use torch's products: %s", _reason[-1])
        return None
    _reason.clear()
    return module


def decodes_here() -> bool:
    """Whether bf16 and int8 layers decode through the kernel on this CPU: wherever it builds (AVX2 or
    AVX-512). Int8 decode steps take it at every row count; bf16 ones everywhere on AVX2, and beside oneDNN
    where :func:`bf16_kernel_wins`."""
    return kernel() is not None


#: Where oneDNN packs bf16 weights too (AVX-512), a bf16 decode step takes the kernel at most this many rows
#: whatever its context, and at most :data:`BF16_LONG_MOST_ROWS` where it attends to at least
#: :data:`BF16_LONG_POSITIONS` positions: a step of a few rows is bound by reading the weights, which the
#: kernel's blocked layout streams faster, and its own attention (which serves where the products take the
#: kernel) reads the KV faster than SDPA, more so the longer the context; with more rows oneDNN's native bf16
#: arithmetic (bf16 activations) wins the products. The default model's whole bf16 decode step on the AMD EPYC
#: Zen 4 VM (2 threads, ms, kernel against oneDNN and SDPA; docs/inference.md): 4 rows 33.0/40.0 at 300
#: positions, 39.7/63.3 at 1,500; 8 rows 40.1/37.6 at 100, 49.0/49.1 at 300, 75.4/104.4 at 1,500; 16 rows
#: 58.2/48.7 at 100, 79.5/77.9 at 300, 71.9/89.2 at 500, 87.8/113.8 at 800; 32 rows 144.0/130.2 at 500.
#: These hold where the kernel widens bf16 for fp32 activations (``SPADE_ROWS_BF16_DOT=0``).
BF16_MOST_ROWS = 4
BF16_LONG_MOST_ROWS = 16
BF16_LONG_POSITIONS = 384
#: The same where the kernel multiplies bf16 natively (:func:`multiplies_bf16`): then its products match
#: oneDNN's up to 16 rows and its attention wins the step to the engine's default batch (32 rows), and further
#: with a long context. The whole step on the Zen 4 VM (2 threads, median of 12 steps, ms, kernel against
#: oneDNN and SDPA): 1 row 16.3/24.7 at 100 positions; 4 rows 15.8/23.9 at 100, 27.2/39.1 at 1,000; 8 rows
#: 23.1/31.3 at 100, 35.0/56.8 at 1,000; 16 rows 38.3/43.9 at 100, 66.7/103.6 at 1,000; 32 rows 69.6/74.3 at
#: 100, 137.4/163.4 at 1,000; 64 rows 113.7/112.5 at 100, 167.6/227.4 at 400.
BF16_NATIVE_MOST_ROWS = 32
BF16_NATIVE_LONG_MOST_ROWS = 64


def bf16_kernel_rows() -> tuple[int, int]:
    """The most rows of a bf16 decode step that take the kernel beside oneDNN's product: whatever the context,
    and with a long one (:data:`BF16_LONG_POSITIONS`); :data:`BF16_NATIVE_MOST_ROWS` and
    :data:`BF16_NATIVE_LONG_MOST_ROWS` where the kernel multiplies bf16 natively, else :data:`BF16_MOST_ROWS`
    and :data:`BF16_LONG_MOST_ROWS`."""
    if multiplies_bf16():
        return BF16_NATIVE_MOST_ROWS, BF16_NATIVE_LONG_MOST_ROWS
    return BF16_MOST_ROWS, BF16_LONG_MOST_ROWS


def bf16_kernel_wins(rows: int, positions: int) -> bool:
    """Beside oneDNN's packed bf16 product (AVX-512, where not :func:`serves_every_bf16_decode`), whether a
    bf16 decode step of ``rows`` rows attending to ``positions`` positions (0: unknown) takes the kernel
    (:func:`bf16_kernel_rows`)."""
    few, many = bf16_kernel_rows()
    return rows <= few or (rows <= many and positions >= BF16_LONG_POSITIONS)


def serves_every_bf16_decode() -> bool:
    """Whether every bf16 decode product goes through the kernel here (AVX2 without AVX-512, where it builds)."""
    return decodes_here() and not cpu_linear.packs_bf16()


def unavailable_reason() -> str | None:
    """Why :func:`kernel` is ``None`` (after it was called), else ``None``."""
    return _reason[-1] if _reason else None


def fits(in_features: int, out_features: int) -> bool:
    """Whether a layer of this shape can multiply through the kernel (where it is available)."""
    return in_features % INPUT_MULTIPLE == 0 and out_features % BLOCK == 0


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (``[out, in]``, bf16 or int8) in the kernel's blocked layout, ``[out/4, in/8, 4, 8]``: for each
    block of 4 outputs, their 8 weights of each group of 8 inputs side by side.

    A decode product streams a block's weights from memory in one pass; read from four ``[out, in]`` rows at
    once, the same weights came at about half the memory's bandwidth (9-11 against 14-16 GB/s for one thread
    on the AVX2 VM, 18 against 27 for two; docs/inference.md). Packed weights stack along their first
    dimension as the ``[out, in]`` ones do: ``cat(pack(a), pack(b)) == pack(cat(a, b))``.

    Raises:
        ValueError: A shape the kernel cannot multiply (:func:`fits`).
    """
    out_features, in_features = weight.shape
    if not fits(in_features, out_features):
        raise ValueError(
            f"the rows kernel multiplies whole blocks of {BLOCK} outputs and groups of {INPUT_MULTIPLE} inputs, "
            f"not [{out_features}, {in_features}] weights"
        )
    blocks = weight.reshape(out_features // BLOCK, BLOCK, in_features // INPUT_MULTIPLE, INPUT_MULTIPLE)
    return blocks.transpose(1, 2).contiguous()


def attention_fits(head_dim: int) -> bool:
    """Whether :func:`decode_attention` takes heads of ``head_dim`` (whole pairs of AVX2 registers)."""
    return head_dim % ATTENTION_DIM_MULTIPLE == 0


def decode_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, keep: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """One query position's attention, in fp32: ``softmax(scale · q kᵀ) v`` over each row's kept positions.

    Args:
        query: ``[rows, heads, 1, dim]``.
        key: ``[rows, kv_heads, length, dim]``, fp32 or bf16 (widened exactly), each position's ``dim`` values
            contiguous (a view of the engine's KV buffer is taken as it is); ``heads`` is a multiple of
            ``kv_heads``, each group of ``heads / kv_heads`` query heads attends to one key/value head
            (grouped-query attention).
        value: shaped as ``key``, of its dtype.
        keep: ``[rows, length]``, true where a row attends (its padding false), or ``None``: every position.
        scale: the scores' factor (``dim ** -0.5`` for Llama).

    Returns:
        ``[rows, heads, 1, dim]``. Each (row, key/value head) sums over its own kept positions in their
        order, so a row's bits do not depend on the rows beside it or on its padding. A row with no kept
        position gets zeros (SDPA gives NaN); a NaN score gives NaN, as SDPA's.
    """
    module = kernel()
    assert module is not None, "the rows kernel is unavailable"
    return module.decode_attention(query.contiguous(), key, value, keep, scale)


def out_features(packed: torch.Tensor) -> int:
    """The outputs of weights in the blocked layout (:func:`pack`)."""
    return packed.shape[0] * BLOCK


def keeps_bf16_kv() -> bool:
    """Whether a decode batch whose bf16 steps multiply natively here (:func:`multiplies_bf16`) keeps its keys and
    values in bf16, which the kernel's attention reads (:attr:`.llama_decode.LlamaDecoder.kv_dtype`); unless
    ``SPADE_ROWS_BF16_KV=0``."""
    return multiplies_bf16() and not turned_off("SPADE_ROWS_BF16_KV")


def fused_elementwise() -> ModuleType | None:
    """The kernel, whose fused norm, rotary embedding and SiLU a lean decode step takes
    (:class:`.llama_decode.LlamaDecoder`), or ``None``: no kernel here, or ``SPADE_ROWS_FUSED=0``."""
    module = kernel()
    return None if module is None or turned_off("SPADE_ROWS_FUSED") else module


@functools.cache
def multiplies_bf16() -> bool:
    """Whether the kernel's bf16 products multiply bf16 pairs natively here (AVX-512 BF16's ``VDPBF16PS``: the
    activations rounded to bf16, two products a lane, fp32 sums) rather than widening the weights to fp32 for
    fp32 activations. Where the CPU has the instruction, unless ``SPADE_ROWS_BF16_DOT=0``; decided once a process."""
    module = kernel()
    return module is not None and not turned_off("SPADE_ROWS_BF16_DOT") and bool(module.bf16_dot_supported())


def bf16_rows(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """``x`` (``[..., in]``, fp32) times bf16 ``[out, in]`` weights transposed, :func:`pack`'d: ``[..., out]`` fp32.

    The activations stay fp32, or where :func:`multiplies_bf16` are rounded to bf16 (as torch's and oneDNN's
    bf16 products round them) and multiplied in pairs natively. Either way each output sums in one order
    whatever the rows beside it."""
    module = kernel()
    assert module is not None, "the rows kernel is unavailable"
    rows = x.reshape(-1, x.shape[-1]).float().contiguous()
    product = module.bf16_dot_rows if multiplies_bf16() else module.bf16_rows
    return product(rows, packed).reshape(*x.shape[:-1], out_features(packed))


def int8_rows(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x`` (``[..., in]``, fp32) times int8 codes (:func:`pack`'d) and fp32 ``scales`` (``[out]``): ``[..., out]``."""
    module = kernel()
    assert module is not None, "the rows kernel is unavailable"
    rows = x.reshape(-1, x.shape[-1]).float().contiguous()
    return module.int8_rows(rows, packed, scales).reshape(*x.shape[:-1], out_features(packed))


if __name__ == "__main__":  # make install: build it now, not in the first server's start
    logging.basicConfig(level=logging.INFO)
    built = kernel()
    print(f"rows kernel: {'built' if built is not None else 'unavailable: ' + str(unavailable_reason())}")
