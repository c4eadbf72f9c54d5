"""Benchmark: the decode step's matrix products on this CPU, fp32 against packed fp32, bf16 and int8 weights.

A decode step of SmolLM2-135M is mostly products of a few rows of activations with the model's
weight matrices; at one row each is a GEMV that reads the whole matrix, so its speed is the speed at
which the kernel reads weights. What a weight format can gain in the engine depends on the CPU's
instructions (``torch.backends.cpu.get_cpu_capability()``: AVX2 on one project VM, AVX512 with
bf16 and VNNI on another), so this measures it where it runs: 60 matrices of the model's MLP shape
(1536 × 576), as the engine calls them — fp32 ``x @ w.T`` (``F.linear``'s product), fp32 with the
weights prepacked for oneDNN (``fp32_packed``: what ``weights: float32`` multiplies,
``services.inference.quant.Fp32Linear``), bf16 ``x @ w.T`` (``weights: bf16`` before oneDNN), bf16
prepacked for oneDNN (``bf16_packed``: what ``weights: bf16`` decode steps multiply), and the int8
kernel the engine's ``weights: int8`` uses (``aten._weight_int8pack_mm``, bf16 activations and
scales), and the engine's own kernel for CPUs without native bf16 (``bf16_rows`` and ``int8_rows``:
fp32 activations times bf16 or int8 weights widened in registers, ``services.inference.rows``; what
``weights: bf16`` and ``int8`` decode steps multiply there) and its native bf16 product where the CPU has
AVX-512 BF16 (``bf16_rows_native``: activations rounded to bf16, ``VDPBF16PS``; what its bf16 decode steps
multiply there) — at 1, 2, 3, 4, 8 and 16 rows, the
median of ``--repeats`` passes, each format's ratio to fp32 measured in the same run, and the bytes
each pass reads over its time. A format this CPU or build cannot run (oneDNN packs bf16 only with
AVX-512 or AVX-NE-CONVERT; the engine's kernel needs AVX2 and a compiler) is left out with a line
saying why.

Usage::

    .venv/bin/python bench/kernel_bench.py [--threads 2] [--repeats 30] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from services.inference import rows as rows_kernel
from services.inference.quant import quantize_rows
from spade.cpu_linear import pack, packed_linear, packs_bf16

SHAPE = (1536, 576)  # SmolLM2-135M's MLP projection (out, in)
MATRICES = 60  # its 30 layers' gate and up projections
ROWS = (1, 2, 3, 4, 8, 16)


def _median_ms(call: Callable[[], object], repeats: int) -> float:
    call()  # warm: first-call allocations and kernel selection
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def _products(x: torch.Tensor, weights: Sequence[torch.Tensor]) -> Callable[[], object]:
    return lambda: [x @ w.T for w in weights]


def _packed_products(x: torch.Tensor, packed: Sequence[torch.Tensor]) -> Callable[[], object]:
    return lambda: [packed_linear(x, p) for p in packed]


def _int8_products(
    x: torch.Tensor, weights: Sequence[torch.Tensor], scales: Sequence[torch.Tensor]
) -> Callable[[], object]:
    kernel = torch.ops.aten._weight_int8pack_mm
    return lambda: [kernel(x, q, s) for q, s in zip(weights, scales, strict=True)]


def _rows_products(
    product: Callable[..., torch.Tensor], x: torch.Tensor, weights: Sequence[torch.Tensor]
) -> Callable[[], object]:
    return lambda: [product(x, w) for w in weights]


def _int8_rows_products(
    x: torch.Tensor, weights: Sequence[torch.Tensor], scales: Sequence[torch.Tensor]
) -> Callable[[], object]:
    return lambda: [rows_kernel.int8_rows(x, q, s) for q, s in zip(weights, scales, strict=True)]


def measure(repeats: int) -> dict[str, Any]:
    """Each format's time for one pass over the matrices at each row count, and its ratio to fp32."""
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(*SHAPE, generator=gen) * 0.02 for _ in range(MATRICES)]
    packed = [pack(w) for w in weights]
    bf16 = [w.bfloat16() for w in weights]
    bf16_packed = [pack(w, torch.bfloat16) for w in weights] if packs_bf16() else None
    int8, scales = zip(*(quantize_rows(w) for w in weights), strict=True)  # the engine's int8 weights
    int8_scales32 = [s.float() for s in scales]
    elements = MATRICES * SHAPE[0] * SHAPE[1]
    bytes_read = {
        "fp32": 4 * elements,
        "fp32_packed": 4 * elements,
        "bf16": 2 * elements,
        "bf16_packed": 2 * elements,
        "int8": elements,
        "bf16_rows": 2 * elements,
        "bf16_rows_native": 2 * elements,
        "int8_rows": elements,
    }
    skipped: dict[str, str] = {}
    if bf16_packed is None:
        skipped["bf16_packed"] = "oneDNN packs no bf16 weights on this CPU"
    if rows_kernel.kernel() is None:
        skipped["bf16_rows"] = skipped["int8_rows"] = f"the engine's kernel: {rows_kernel.unavailable_reason()}"
    module = rows_kernel.kernel()
    if module is None or not module.bf16_dot_supported():
        skipped["bf16_rows_native"] = "the engine's kernel is unavailable or this CPU has no AVX-512 BF16"
    bf16_blocked = [rows_kernel.pack(w) for w in bf16]  # the kernel's layout
    int8_blocked = [rows_kernel.pack(q) for q in int8]
    results: dict[str, Any] = {
        "capability": torch.backends.cpu.get_cpu_capability(),
        "load_average_at_start": os.getloadavg()[0],
        "skipped": skipped,
        "rows": {},
    }
    for rows in ROWS:
        x = torch.randn(rows, SHAPE[1], generator=gen)
        xb = x.bfloat16()
        calls: dict[str, Callable[[], object]] = {
            "fp32": _products(x, weights),
            "fp32_packed": _packed_products(x, packed),
            "bf16": _products(xb, bf16),
            "int8": _int8_products(xb, int8, scales),
        }
        if bf16_packed is not None:
            calls["bf16_packed"] = _packed_products(xb, bf16_packed)
        if module is not None:
            calls["bf16_rows"] = _rows_products(module.bf16_rows, x, bf16_blocked)
            calls["int8_rows"] = _int8_rows_products(x, int8_blocked, int8_scales32)
            if "bf16_rows_native" not in skipped:
                calls["bf16_rows_native"] = _rows_products(module.bf16_dot_rows, x, bf16_blocked)
        ms = {name: _median_ms(call, repeats) for name, call in calls.items()}
        results["rows"][rows] = {
            name: {
                "ms": round(t, 3),
                "vs_fp32": round(ms["fp32"] / t, 2),
                "read_gb_s": round(bytes_read[name] / (t / 1000) / 1e9, 1),
            }
            for name, t in ms.items()
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (the engine's, on a 2-core machine)")
    parser.add_argument("--repeats", type=int, default=30, help="timed passes per format and row count")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = measure(args.repeats)
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(
        f"CPU capability: {results['capability']}; {MATRICES} matrices of {SHAPE[0]}x{SHAPE[1]}, {args.threads} threads"
    )
    for name, why in results["skipped"].items():
        print(f"{name}: not measured, {why}")
    for rows, formats in results["rows"].items():
        line = ", ".join(
            f"{name} {f['ms']:.2f} ms ({f['vs_fp32']:.2f}x fp32, {f['read_gb_s']:.1f} GB/s of weights)"
            for name, f in formats.items()
        )
        print(f"{rows:>2} row(s): {line}")


if __name__ == "__main__":
    main()
