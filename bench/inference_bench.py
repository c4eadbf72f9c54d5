"""Benchmark: embedded server throughput vs plain sequential ``model.generate``.

Prints generated tokens/s at several concurrency levels through the real client and HTTP app
(in-process ASGI transport), and the same model's ``model.generate`` run sequentially on the same
prompts as the baseline, measured in the same run; the ratio is throughput / baseline. Both sides
decode greedily and produce exactly ``--tokens`` tokens per prompt (EOS ignored), so they do the
same work. The engine's prefix cache (on by default, as SGLang's radix cache is) reuses the KV of
the system prompt that all chat prompts share; ``--prefix-cache-tokens 0`` measures without it.

    .venv/bin/python bench/inference_bench.py [--tokens 32] [--levels 1 4 16] [--threads N]
"""

from __future__ import annotations

import argparse
import asyncio
import time

import httpx
import torch

from services.inference.app import create_app
from services.inference.engine import BatchEngine
from spade.inference import InferenceClient, SamplingParams

TOPICS = [
    "the sea", "prime numbers", "a robot that learns to paint", "rivers", "gravity", "the moon",
    "a chess opening", "bread baking", "volcanoes", "a locked room puzzle", "trains", "honey bees",
    "sorting algorithms", "the water cycle", "a lighthouse keeper", "compound interest",
]  # fmt: skip


def prompts(engine: BatchEngine, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        messages = [{"role": "user", "content": f"Write a short paragraph about {topic}."}]
        ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        out.append([int(t) for t in ids])  # type: ignore[arg-type]
    return out


def baseline(engine: BatchEngine, batch: list[list[int]], tokens: int) -> float:
    """Tokens/s of sequential ``model.generate`` (KV cache on, greedy) on the same prompts."""
    model = engine.model
    start = time.perf_counter()
    produced = 0
    with torch.inference_mode():
        for ids in batch:
            out = model.generate(  # type: ignore[operator]
                torch.tensor([ids]),
                attention_mask=torch.ones((1, len(ids)), dtype=torch.long),
                max_new_tokens=tokens,
                min_new_tokens=tokens,
                do_sample=False,
                pad_token_id=engine.eos_ids[0],
            )
            produced += out.shape[1] - len(ids)
    return produced / (time.perf_counter() - start)


async def served(client: InferenceClient, batch: list[list[int]], tokens: int) -> float:
    """Tokens/s with all of ``batch`` in flight at once through the client."""
    params = SamplingParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    results = await asyncio.gather(*(client.generate(ids, params) for ids in batch))
    elapsed = time.perf_counter() - start
    return sum(len(r.output_ids) for r in results) / elapsed


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=32, help="tokens generated per request")
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 4, 16], help="concurrency levels")
    parser.add_argument("--baseline-prompts", type=int, default=4, help="prompts in the sequential baseline")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument(
        "--prefix-cache-tokens", type=int, default=8192, help="engine prefix cache size; 0 turns it off"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    engine = BatchEngine(
        None,
        max_batch_size=max(args.levels),
        torch_threads=args.threads,
        prefix_cache_tokens=args.prefix_cache_tokens,
    )
    engine.start()
    app = create_app(engine)
    try:
        async with InferenceClient(
            ["http://bench"], transports={"http://bench": httpx.ASGITransport(app=app)}
        ) as client:
            await served(client, prompts(engine, 2), 4)  # warm-up
            base = baseline(engine, prompts(engine, args.baseline_prompts), args.tokens)
            print(
                f"torch threads: {args.threads or torch.get_num_threads()}, tokens per request: {args.tokens}, "
                f"prefix cache: {args.prefix_cache_tokens} tokens (prompts share the chat template's system prompt)"
            )
            print(f"baseline  sequential model.generate: {base:8.1f} tok/s")
            for level in args.levels:
                rate = await served(client, prompts(engine, level), args.tokens)
                print(f"embedded  {level:3d} concurrent requests: {rate:8.1f} tok/s   ratio {rate / base:5.2f}x")
    finally:
        engine.close()


if __name__ == "__main__":
    asyncio.run(main())
