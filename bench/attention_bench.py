"""Benchmark: causal attention, the kernel prompts and the learner share (``spade.attention``) against torch's SDPA.

SmolLM2-135M's attention (9 query heads on 3 key/value heads of 64 dims), one layer, as the model calls it:

- ``prefill``: a prompt's new tokens after a cached prefix (``new`` queries, ``prefix + new`` keys), forward
  only, fp32 as the engine prefills: SDPA with its causal mask (``is_causal`` where there is no prefix);
- ``train``: one packed sequence of ``length`` tokens, forward and backward, bf16 as the learner's autocast
  gives them (and fp32): SDPA ``is_causal``.

Each figure is the best of ``--repeats`` passes, each side measured in the same run; the ratio is SDPA's time
over the kernel's, and GFLOP/s counts the causal products (2 per multiply-add, the masked half left out).

Usage::

    .venv/bin/python bench/attention_bench.py [--threads 2] [--repeats 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from spade import attention

HEADS, KV_HEADS, DIM = 9, 3, 64


def _best(run: Callable[[], Any], repeats: int) -> float:
    run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def _flops(queries: int, keys: int) -> float:
    """Products of the scores and the weighed values over the keys each query sees (query i: keys - queries + i + 1)."""
    seen = queries * (keys - queries) + queries * (queries + 1) / 2
    return 2 * 2 * HEADS * DIM * seen


def prefill(new: int, prefix: int, repeats: int) -> dict[str, Any]:
    q = torch.randn(1, HEADS, new, DIM)
    k, v = torch.randn(1, KV_HEADS, prefix + new, DIM), torch.randn(1, KV_HEADS, prefix + new, DIM)
    mask = None if prefix == 0 else torch.ones(new, prefix + new, dtype=torch.bool).tril(prefix)
    sdpa = _best(
        lambda: nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True
        ),
        repeats,
    )
    kernel = _best(lambda: attention.causal_attention(q[0], k[0], v[0], DIM**-0.5), repeats)
    return _row(f"prefill {new} after {prefix}", sdpa, kernel, _flops(new, prefix + new))


def train(length: int, dtype: torch.dtype, repeats: int) -> dict[str, Any]:
    q = torch.randn(1, HEADS, length, DIM, dtype=dtype, requires_grad=True)
    k = torch.randn(1, KV_HEADS, length, DIM, dtype=dtype, requires_grad=True)
    v = torch.randn(1, KV_HEADS, length, DIM, dtype=dtype, requires_grad=True)
    grad = torch.randn(1, HEADS, length, DIM, dtype=dtype)

    def sdpa() -> None:
        nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).backward(grad)

    def kernel() -> None:
        attention.causal_attention(q[0], k[0], v[0], DIM**-0.5).backward(grad[0])

    theirs, ours = _best(sdpa, repeats), _best(kernel, repeats)
    flops = 3.5 * _flops(length, length)  # forward 2 products, backward 5
    return _row(f"train {length} {str(dtype).removeprefix('torch.')}", theirs, ours, flops)


def _row(case: str, sdpa: float, kernel: float, flops: float) -> dict[str, Any]:
    """One case's figures: both sides' times (s in, ms out), SDPA's over the kernel's, and each side's GFLOP/s."""
    return {
        "case": case,
        "sdpa_ms": sdpa * 1e3,
        "kernel_ms": kernel * 1e3,
        "ratio": sdpa / kernel,
        "kernel_gflops": flops / kernel / 1e9,
        "sdpa_gflops": flops / sdpa / 1e9,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (the engine's, on a 2-core machine)")
    parser.add_argument("--repeats", type=int, default=5, help="timed passes per side and case")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if attention.kernel() is None:
        raise SystemExit(f"the attention kernel is unavailable here: {attention.unavailable_reason()}")
    rows = [prefill(new, prefix, args.repeats) for new, prefix in ((300, 0), (1000, 0), (100, 800), (40, 1000))]
    for length in (300, 600, 1200, 2000):
        rows += [train(length, dtype, args.repeats) for dtype in (torch.bfloat16, torch.float32)]
    if args.json:
        print(json.dumps({"threads": args.threads, "cases": rows}, indent=2))
        return
    print(f"causal attention, one layer of SmolLM2-135M ({HEADS}/{KV_HEADS} heads of {DIM}), {args.threads} threads")
    print(f"{'case':<24}{'SDPA ms':>10}{'kernel ms':>11}{'ratio':>8}{'SDPA GFLOP/s':>14}{'kernel GFLOP/s':>16}")
    for row in rows:
        print(
            f"{row['case']:<24}{row['sdpa_ms']:>10.2f}{row['kernel_ms']:>11.2f}{row['ratio']:>7.2f}x"
            f"{row['sdpa_gflops']:>14.0f}{row['kernel_gflops']:>16.0f}"
        )


if __name__ == "__main__":
    main()
