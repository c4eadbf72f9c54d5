"""The batch-invariant mode with the real SmolLM2: a seeded request's numbers do not move with the traffic.

Each claim comes with its control: the same requests without the mode do move (logprob bits) when the
concurrency changes or when a prefix comes from the cache, so the mode is what makes the difference.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path

import httpx
import pytest

from services.inference.engine import BatchEngine, GenerationJob, GenerationOutcome
from spade.inference.protocol import SamplingParams
from tests.integration.inference.conftest import chat_ids

pytestmark = [pytest.mark.slow, pytest.mark.model, pytest.mark.timeout(1200)]

QUESTIONS = (
    "What is 17 times 23? Think step by step.",
    "Name three prime numbers above 50.",
    "Write a haiku about rivers.",
    "Explain why the sky is blue in one sentence.",
)
OTHER_TRAFFIC = ("Count from one to twenty.", "List the planets of the solar system in order.")
TOKENS = 24


def seeded_jobs(engine: BatchEngine, *, invariant: bool, tokens: int = TOKENS) -> list[GenerationJob]:
    jobs = []
    for i, question in enumerate(QUESTIONS):
        params = SamplingParams(max_new_tokens=tokens, temperature=0.7, sampling_seed=1000 + i)
        jobs.append(GenerationJob(chat_ids(engine, question), params.with_batch_invariance() if invariant else params))
    return jobs


async def run(
    engine: BatchEngine, jobs: list[GenerationJob], concurrency: int, *, other_traffic: bool = False
) -> list[GenerationOutcome]:
    """The jobs, at most ``concurrency`` at once (with unrelated batched requests in flight meanwhile)."""
    gate = asyncio.Semaphore(concurrency)
    spans: list[tuple[float, float]] = []

    async def one(job: GenerationJob) -> GenerationOutcome:
        async with gate:
            start = time.monotonic()
            outcome = await engine.generate(job)
            spans.append((start, time.monotonic()))
            return outcome

    others = [
        engine.generate(GenerationJob(chat_ids(engine, q), SamplingParams(max_new_tokens=2 * TOKENS, ignore_eos=True)))
        for q in (OTHER_TRAFFIC if other_traffic else ())
    ]
    outcomes, _ = await asyncio.gather(asyncio.gather(*(one(j) for j in jobs)), asyncio.gather(*others))
    spans.sort()
    overlapping = any(later[0] < earlier[1] for earlier, later in itertools.pairwise(spans))
    assert overlapping == (concurrency > 1), "the requests did not run the way the test means them to"
    return list(outcomes)


def mean_batch(engine: BatchEngine, before: tuple[int, int]) -> float:
    steps, rows = engine.work.decode_steps - before[0], engine.work.decode_rows - before[1]
    return rows / max(steps, 1)


def invariant_batch(engine: BatchEngine, before: tuple[int, int]) -> float:
    steps, rows = engine.work.invariant_steps - before[0], engine.work.invariant_rows - before[1]
    return rows / max(steps, 1)


async def test_seeded_requests_give_the_same_tokens_and_logprobs_at_any_concurrency(engine: BatchEngine) -> None:
    engine.flush_cache()
    alone = await run(engine, seeded_jobs(engine, invariant=True), concurrency=1)
    engine.flush_cache()
    before = (engine.work.invariant_steps, engine.work.invariant_rows)
    crowded = await run(engine, seeded_jobs(engine, invariant=True), concurrency=4, other_traffic=True)
    # The invariant rows shared their passes (llama_decode.LlamaDecoder.apart) where this CPU's products
    # allow it (they do on the machines measured), and still moved no bit.
    assert engine.decoder is not None
    together = engine.decoder.rows_apart is not None
    assert invariant_batch(engine, before) > 1.5 if together else invariant_batch(engine, before) == 1.0
    for a, b in zip(alone, crowded, strict=True):
        assert a.output_ids == b.output_ids
        assert a.output_logprobs == b.output_logprobs  # bit for bit, not approximately
        assert len(a.output_ids) > 1


async def test_rows_kept_apart_decode_one_pass_each_and_still_agree(engine: BatchEngine) -> None:
    # The fallback where the products are not row-invariant (or invariant_rows_together is off).
    engine.invariant_rows_together = False
    try:
        engine.flush_cache()
        alone = await run(engine, seeded_jobs(engine, invariant=True, tokens=12), concurrency=1)
        engine.flush_cache()
        before = (engine.work.invariant_steps, engine.work.invariant_rows)
        crowded = await run(engine, seeded_jobs(engine, invariant=True, tokens=12), concurrency=4, other_traffic=True)
        assert invariant_batch(engine, before) == 1.0
    finally:
        engine.invariant_rows_together = True
    for a, b in zip(alone, crowded, strict=True):
        assert (a.output_ids, a.output_logprobs) == (b.output_ids, b.output_logprobs)


async def test_bf16_weights_keep_the_mode(model_dir: Path) -> None:
    # Bf16 weights prefill with bf16 products where the CPU has them (quant.Bf16Linear.kernel_prefills):
    # the mode's fixed chunks and its rows' shared decode passes still give one answer at any concurrency.
    bf16 = BatchEngine(model_dir, max_batch_size=8, torch_threads=1, weights="bf16")
    bf16.start()
    try:
        alone = await run(bf16, seeded_jobs(bf16, invariant=True, tokens=12), concurrency=1)
        bf16.flush_cache()
        before = (bf16.work.invariant_steps, bf16.work.invariant_rows)
        crowded = await run(bf16, seeded_jobs(bf16, invariant=True, tokens=12), concurrency=4, other_traffic=True)
        assert bf16.decoder is not None
        together = bf16.decoder.rows_apart is not None
        assert invariant_batch(bf16, before) > 1.5 if together else invariant_batch(bf16, before) == 1.0
    finally:
        bf16.close()
    for a, b in zip(alone, crowded, strict=True):
        assert (a.output_ids, a.output_logprobs) == (b.output_ids, b.output_logprobs)


async def test_without_the_mode_the_same_requests_move_with_the_concurrency(engine: BatchEngine) -> None:
    engine.flush_cache()
    alone = await run(engine, seeded_jobs(engine, invariant=False), concurrency=1)
    engine.flush_cache()
    before = (engine.work.decode_steps, engine.work.decode_rows)
    crowded = await run(engine, seeded_jobs(engine, invariant=False), concurrency=4)
    assert mean_batch(engine, before) > 1.5  # they really shared decode steps
    moved = [
        (a.output_ids, a.output_logprobs) != (b.output_ids, b.output_logprobs)
        for a, b in zip(alone, crowded, strict=True)
    ]
    assert any(moved), "batching changed no logprob: the engine is already invariant and the mode proves nothing"


async def test_the_server_setting_makes_every_request_invariant(engine: BatchEngine, http: httpx.AsyncClient) -> None:
    info = (await http.get("/get_server_info")).json()
    assert info["enable_deterministic_inference"] is False and info["batch_invariant_requests"] is True
    engine.batch_invariant = True  # what SPADE_INFERENCE_ENABLE_DETERMINISTIC_INFERENCE=1 builds
    try:
        assert (await http.get("/server_info")).json()["enable_deterministic_inference"] is True
        engine.flush_cache()
        alone = await run(engine, seeded_jobs(engine, invariant=False, tokens=16), concurrency=1)
        engine.flush_cache()
        crowded = await run(engine, seeded_jobs(engine, invariant=False, tokens=16), concurrency=4)
    finally:
        engine.batch_invariant = False
    for a, b in zip(alone, crowded, strict=True):
        assert (a.output_ids, a.output_logprobs) == (b.output_ids, b.output_logprobs)


async def test_a_prefix_from_the_cache_gives_the_numbers_of_computing_it_fresh(engine: BatchEngine) -> None:
    chunk = engine.invariant_chunk_tokens
    story = " ".join(f"Day {d}: the river rose by {d % 7} inches and the ferry ran {d % 3} times." for d in range(30))
    prompt = chat_ids(engine, story + " On which days did the ferry not run?")
    assert len(prompt) > 2 * chunk + 10

    def job(ids: list[int], invariant: bool = True) -> GenerationJob:
        params = SamplingParams(max_new_tokens=12, temperature=0.7, sampling_seed=7)
        return GenerationJob(ids, params.with_batch_invariance() if invariant else params)

    engine.flush_cache()
    fresh = await engine.generate(job(prompt))
    again = await engine.generate(job(prompt))
    assert (fresh.cached_tokens, again.cached_tokens) == (0, len(prompt) // chunk * chunk)
    assert (again.output_ids, again.output_logprobs) == (fresh.output_ids, fresh.output_logprobs)

    # The next turn resends the first reply: the history's whole chunks come from the cache.
    turn2 = prompt + fresh.output_ids + engine.tokenizer.encode(" Answer in one word.", add_special_tokens=False)
    reused = await engine.generate(job(turn2))
    engine.flush_cache()
    computed = await engine.generate(job(turn2))
    assert reused.cached_tokens >= len(prompt) // chunk * chunk and computed.cached_tokens == 0
    assert (reused.output_ids, reused.output_logprobs) == (computed.output_ids, computed.output_logprobs)

    # Control: without the mode the cache reuses all but the last prompt token, and the numbers move.
    engine.flush_cache()
    plain_fresh = await engine.generate(job(prompt, invariant=False))
    plain_again = await engine.generate(job(prompt, invariant=False))
    assert plain_again.cached_tokens == len(prompt) - 1
    assert plain_again.output_logprobs != plain_fresh.output_logprobs
