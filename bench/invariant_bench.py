"""Benchmark: batch-invariant requests decoded together against one pass per row.

An eval asks the engine for batch-invariant requests (docs/inference.md, "Batch-invariant mode"): a
request's numbers must not depend on what else runs. Its rows used to decode one pass each, which
gave up batching; where the lean decode step's products are row-invariant on this CPU they now
share passes, each row attending to its own KV (``LlamaDecoder.apart``). This measures the two on
the engine's own scheduler with the default model: ``--requests`` seeded eval-like requests (a
prompt of about ``--prompt-words`` words, ``--tokens`` new tokens each) at ``--levels`` concurrency,
interleaved, the caches flushed before each run. It prints tokens/s of each mode, their ratio from
the same run, and whether both modes gave the same tokens (they do where the probe found one-row
products invariant too; otherwise each mode is invariant on its own but the two differ by rounding).

Usage::

    .venv/bin/python bench/invariant_bench.py [--threads 2] [--weights bf16] [--levels 1 4 8] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

import torch

from services.inference.engine import BatchEngine, GenerationJob, GenerationOutcome
from spade.inference.models import ensure_default_model
from spade.inference.protocol import SamplingParams

TOPICS = ("rivers", "prime numbers", "the solar system", "ferries", "bridges", "tides", "forests", "glaciers")


def _jobs(engine: BatchEngine, requests: int, words: int, tokens: int) -> list[GenerationJob]:
    jobs = []
    for i in range(requests):
        topic = TOPICS[i % len(TOPICS)]
        text = f"Item {i}. " + " ".join(f"Fact {w} about {topic}." for w in range(words // 4)) + " Summarise."
        ids = engine.tokenizer(text)["input_ids"]
        params = SamplingParams(max_new_tokens=tokens, temperature=0.6, sampling_seed=100 + i, ignore_eos=True)
        jobs.append(GenerationJob(list(ids), params.with_batch_invariance()))
    return jobs


async def _run(engine: BatchEngine, jobs: list[GenerationJob], concurrency: int) -> tuple[float, list[Any]]:
    gate = asyncio.Semaphore(concurrency)

    async def one(job: GenerationJob) -> GenerationOutcome:
        async with gate:
            return await engine.generate(job)

    engine.flush_cache()
    start = time.perf_counter()
    outcomes = await asyncio.gather(*(one(job) for job in jobs))
    elapsed = time.perf_counter() - start
    return elapsed, [(o.output_ids, o.output_logprobs) for o in outcomes]


async def _measure(args: argparse.Namespace) -> dict[str, Any]:
    engine = BatchEngine(ensure_default_model(), torch_threads=args.threads, weights=args.weights, max_batch_size=32)
    engine.start()
    try:
        jobs = _jobs(engine, args.requests, args.prompt_words, args.tokens)
        await _run(engine, jobs[:2], 2)  # warm up (and probe the products once)
        assert engine.decoder is not None
        least = engine.decoder.rows_apart
        results = []
        for level in args.levels:
            times: dict[bool, list[float]] = {False: [], True: []}
            answers: dict[bool, list[Any]] = {}
            for _ in range(args.repeats):
                for together in (False, True):
                    engine.invariant_rows_together = together
                    elapsed, answers[together] = await _run(engine, jobs, level)
                    times[together].append(elapsed)
            tokens = args.requests * args.tokens
            alone, shared = statistics.median(times[False]), statistics.median(times[True])
            results.append(
                {
                    "concurrency": level,
                    "alone_tok_s": tokens / alone,
                    "together_tok_s": tokens / shared,
                    "ratio": alone / shared,
                    "same_tokens": answers[False] == answers[True],
                }
            )
            if not args.json:
                r = results[-1]
                print(
                    f"concurrency {level:2d}: one pass a row {r['alone_tok_s']:6.1f} tok/s, rows together "
                    f"{r['together_tok_s']:6.1f} tok/s ({r['ratio']:.2f}x); same tokens and logprobs: "
                    f"{r['same_tokens']}",
                    flush=True,
                )
    finally:
        engine.close()
    return {"threads": args.threads, "weights": args.weights, "rows_apart_from": least, "results": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--weights", default="bf16", choices=["float32", "bf16", "int8", "int4"])
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-words", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    figures = asyncio.run(_measure(args))
    if args.json:
        print(json.dumps(figures))
    else:
        print(f"products row-invariant from {figures['rows_apart_from']} rows ({args.weights}, {args.threads} threads)")


if __name__ == "__main__":
    main()
