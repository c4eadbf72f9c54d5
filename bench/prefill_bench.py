"""Benchmark: prefilling short prompts admitted together, one pass each against shared passes.

An agent's next turn is a few dozen new tokens after a conversation the prefix cache holds. The
engine prefills such prompts admitted in one scheduler iteration several to a pass
(``services/inference/prefill.py``); this measures that against prefilling each alone
(``prefill_batch_tokens=0``), on the engine's own admission path with the default model: ``rows``
conversations of ``--cached`` tokens are prefilled into the prefix cache, then each gets ``new``
more tokens and all are admitted together. It prints the best of ``--repeats`` for each mode and
their ratio, measured in the same run.

Usage::

    .venv/bin/python bench/prefill_bench.py [--threads 2] [--cached 450] [--repeats 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from services.inference.engine import BatchEngine, GenerationJob
from spade.inference.models import ensure_default_model
from spade.inference.protocol import SamplingParams

ROWS = (1, 4, 8, 16)
NEW = (16, 64, 128)


def _admit(engine: BatchEngine, prompts: list[list[int]]) -> float:
    jobs = [GenerationJob(p, SamplingParams(max_new_tokens=1)) for p in prompts]
    start = time.perf_counter()
    with torch.inference_mode():
        engine._prefill_admitted(jobs)
    return time.perf_counter() - start


def _once(engine: BatchEngine, rows: int, new: int, cached: int, together: bool) -> float:
    engine.prefill_batch_tokens = 1024 if together else 0
    engine.prefix_cache.clear()
    # Each row's conversation so far: a shared system part, then its own turns (cached below).
    system = list(range(1000, 1000 + cached - 50))
    history = [[*system, *([2000 + r] * 50)] for r in range(rows)]
    _admit(engine, history)
    turns = [[*h, *range(3000 + 200 * r, 3000 + 200 * r + new)] for r, h in enumerate(history)]
    return _admit(engine, turns)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cached", type=int, default=450, help="tokens of each conversation already cached")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = BatchEngine(ensure_default_model(), torch_threads=args.threads)
    results: list[dict[str, Any]] = []
    for rows in ROWS:
        for new in NEW:
            alone = min(_once(engine, rows, new, args.cached, False) for _ in range(args.repeats))
            shared = min(_once(engine, rows, new, args.cached, True) for _ in range(args.repeats))
            result = {"rows": rows, "new": new, "alone_ms": alone * 1e3, "shared_ms": shared * 1e3}
            result["ratio"] = alone / shared
            results.append(result)
            if not args.json:
                print(
                    f"{rows:2d} rows x {new:3d} new tokens: alone {alone * 1e3:7.1f} ms, "
                    f"shared passes {shared * 1e3:7.1f} ms ({alone / shared:.2f}x)",
                    flush=True,
                )
    if args.json:
        print(json.dumps({"threads": args.threads, "cached": args.cached, "results": results}))


if __name__ == "__main__":
    main()
