"""Benchmark: the embedded server's throughput, and G plays sharing a prompt via ``n = G``.

**Plays sharing a prompt** (issue 14): the G plays of one env start from the same prompt (system
prompt, the env's rules, the first observation). Measured in the same run, on one rollout-sized
prompt (``--prompt-words``), ``--group`` samples of ``--group-tokens`` tokens each (temperature 0.6,
EOS ignored so every configuration produces the same number of tokens):

- ``independent_no_cache``: G concurrent requests, prefix cache off: each pays its own prefill (the
  baseline, as before this work);
- ``independent_radix``: G concurrent requests with the radix cache: the first prefills, the others
  find the prompt cached (all but its last token);
- ``parallel_n``: one request with ``sampling_params.n = G``: one prefill, G rows decoded together.

The cache is flushed before every measurement; each is repeated ``--repeats`` times (interleaved)
and the median reported. Ratios are plays/s over the baseline's.

**Throughput**: prints generated tokens/s at several concurrency levels through the real client and HTTP app
(in-process ASGI transport), and the same model's ``model.generate`` run sequentially on the same
prompts as the baseline, measured in the same run; the ratio is throughput / baseline. Both sides
decode greedily and produce exactly ``--tokens`` tokens per prompt (EOS ignored), so they do the
same work. The engine's prefix cache (on by default, as SGLang's radix cache is) reuses the KV of
the system prompt that all chat prompts share; ``--prefix-cache-tokens 0`` measures without it.

    .venv/bin/python bench/inference_bench.py [--tokens 32] [--levels 1 4 16] [--threads N]
        [--group 8] [--group-tokens 32] [--prompt-words 400] [--repeats 3] [--json]

``--json`` prints one object instead: the figures, the baseline's figures, the ratios, the settings
and ``os.getloadavg()`` at start, so runs can be compared.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from typing import Any

import httpx
import torch

from services.inference.app import create_app
from services.inference.engine import BatchEngine
from services.inference.prefix_cache import RadixPrefixCache
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


RULES = (
    "You are playing a puzzle environment. Each turn you send one action and receive an observation. "
    "The hidden state is a grid of cells; some cells hold keys, some hold doors, and the rest are empty. "
    "A door opens only with the key of the same colour, and a key is used up when it opens a door. "
    "Moving into a wall costs a turn and changes nothing. The episode ends when you reach the exit, "
    "or when the turn budget runs out. Write your action inside \\boxed{...}, for example "
    "\\boxed{move north} or \\boxed{pick key}. "
)


def group_prompt(engine: BatchEngine, words: int) -> list[int]:
    """A rollout-sized first prompt: a system prompt with the env's rules, then the first observation."""
    rules = " ".join((RULES * (words // len(RULES.split()) + 1)).split()[:words])
    messages = [
        {"role": "system", "content": rules},
        {"role": "user", "content": "Observation: you stand at (0, 0); a red key lies at (2, 1). Your move?"},
    ]
    ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    return [int(t) for t in ids]  # type: ignore[arg-type]


async def group_plays(
    client: InferenceClient, engine: BatchEngine, prompt: list[int], group: int, tokens: int, mode: str, cache: int
) -> float:
    """Plays/s for ``group`` samples of ``prompt`` in one configuration (see the module docstring)."""
    engine.prefix_cache = RadixPrefixCache(cache)  # idle here: a fresh (flushed) cache of that size
    params = SamplingParams(max_new_tokens=tokens, temperature=0.6, ignore_eos=True)
    start = time.perf_counter()
    if mode == "parallel_n":
        results = await client.generate_n(prompt, params, n=group)
    else:
        results = list(await asyncio.gather(*(client.generate(prompt, params) for _ in range(group))))
    elapsed = time.perf_counter() - start
    assert len(results) == group and all(len(r.output_ids) == tokens for r in results)
    return group / elapsed


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=32, help="tokens generated per request")
    parser.add_argument(
        "--levels", type=int, nargs="*", default=[1, 4, 16], help="concurrency levels (none: skip throughput)"
    )
    parser.add_argument("--group", type=int, default=8, help="plays sharing one prompt (G)")
    parser.add_argument("--group-tokens", type=int, default=32, help="tokens generated per play")
    parser.add_argument("--prompt-words", type=int, default=400, help="words of env rules in the shared prompt")
    parser.add_argument("--repeats", type=int, default=3, help="measurements per configuration (median)")
    parser.add_argument("--json", action="store_true", help="print one JSON object with every figure")
    parser.add_argument("--baseline-prompts", type=int, default=4, help="prompts in the sequential baseline")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument(
        "--prefix-cache-tokens", type=int, default=8192, help="engine prefix cache size; 0 turns it off"
    )
    args = parser.parse_args()
    load_at_start = os.getloadavg()
    if args.threads:
        torch.set_num_threads(args.threads)

    engine = BatchEngine(
        None,
        max_batch_size=max([*args.levels, args.group]),
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
            report: dict[str, Any] = {
                "benchmark": "inference",
                "loadavg_start": list(load_at_start),
                "settings": {
                    "torch_threads": args.threads or torch.get_num_threads(),
                    "group": args.group,
                    "group_tokens": args.group_tokens,
                    "repeats": args.repeats,
                    "tokens": args.tokens,
                    "levels": args.levels,
                    "prefix_cache_tokens": args.prefix_cache_tokens,
                },
            }
            # G plays sharing a prompt.
            prompt = group_prompt(engine, args.prompt_words)
            report["settings"]["prompt_tokens"] = len(prompt)
            modes = {
                "independent_no_cache": ("independent", 0),
                "independent_radix": ("independent", args.prefix_cache_tokens),
                "parallel_n": ("parallel_n", args.prefix_cache_tokens),
            }
            runs: dict[str, list[float]] = {name: [] for name in modes}
            for _ in range(args.repeats):
                for name, (mode, cache) in modes.items():
                    plays = await group_plays(client, engine, prompt, args.group, args.group_tokens, mode, cache)
                    runs[name].append(plays)
            engine.prefix_cache = RadixPrefixCache(args.prefix_cache_tokens)
            plays_per_s = {name: statistics.median(values) for name, values in runs.items()}
            base_plays = plays_per_s["independent_no_cache"]
            report["figures"] = {"plays_per_s": plays_per_s, "plays_per_s_runs": runs}
            report["baseline"] = {"name": "independent_no_cache", "plays_per_s": base_plays}
            report["ratios"] = {
                "parallel_n_vs_independent_no_cache": plays_per_s["parallel_n"] / base_plays,
                "parallel_n_vs_independent_radix": plays_per_s["parallel_n"] / plays_per_s["independent_radix"],
                "independent_radix_vs_independent_no_cache": plays_per_s["independent_radix"] / base_plays,
            }
            if not args.json:
                print(
                    f"G={args.group} plays sharing a {len(prompt)}-token prompt, {args.group_tokens} tokens each "
                    f"(median of {args.repeats}; load average at start {load_at_start[0]:.1f})"
                )
                for name, plays in plays_per_s.items():
                    print(f"  {name:22s} {plays:7.3f} plays/s   ratio {plays / base_plays:5.2f}x")
            # Throughput against sequential model.generate.
            if args.levels:
                base = baseline(engine, prompts(engine, args.baseline_prompts), args.tokens)
                report["baseline"]["sequential_generate_tok_per_s"] = base
                report["figures"]["tok_per_s"] = {}
                if not args.json:
                    print(f"baseline  sequential model.generate: {base:8.1f} tok/s")
                for level in args.levels:
                    rate = await served(client, prompts(engine, level), args.tokens)
                    report["figures"]["tok_per_s"][str(level)] = rate
                    report["ratios"][f"tok_per_s_{level}_vs_sequential"] = rate / base
                    if not args.json:
                        print(
                            f"embedded  {level:3d} concurrent requests: {rate:8.1f} tok/s   ratio {rate / base:5.2f}x"
                        )
            if args.json:
                print(json.dumps(report, indent=2))
    finally:
        engine.close()


if __name__ == "__main__":
    asyncio.run(main())
