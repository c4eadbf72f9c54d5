"""n > 1, seeds and the radix cache on the real SmolLM2 model."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from services.inference.app import create_app
from services.inference.engine import BatchEngine, GenerationJob
from spade.inference import InferenceClient, SamplingParams
from tests.integration.inference.conftest import chat_ids, teacher_forced_logprobs

pytestmark = pytest.mark.slow

PROMPT = "Write a list of random words."


async def test_n_samples_share_one_prefill_and_keep_teacher_forced_logprobs(
    http: httpx.AsyncClient, engine: BatchEngine
) -> None:
    """SGLang's shape for n > 1 (a list of n results), n distinct continuations at temperature > 0,
    and every sample's logprobs equal to a float32 teacher-forced pass within 1e-4."""
    prompt = chat_ids(engine, PROMPT)
    assert (await http.post("/flush_cache")).status_code == 200
    torch.manual_seed(0)  # unseeded samples use the global RNG: fix it so the test cannot be unlucky
    body = {
        "input_ids": prompt,
        "sampling_params": {"n": 4, "max_new_tokens": 10, "temperature": 1.2},
        "return_logprob": True,
    }
    response = await http.post("/generate", json=body)
    assert response.status_code == 200, response.text
    samples = response.json()
    assert isinstance(samples, list) and len(samples) == 4
    assert len({tuple(s["output_ids"]) for s in samples}) == 4, "n samples should differ at temperature 1.2"
    assert len({s["meta_info"]["id"] for s in samples}) == 4
    for s in samples:
        meta = s["meta_info"]
        assert meta["prompt_tokens"] == len(prompt) and meta["weight_version"] == engine.weight_version
        assert meta["cached_tokens"] == 0, "one prefill for all n: none of them found the prompt cached"
        served = [lp for lp, _, _ in meta["output_token_logprobs"]]
        reference = teacher_forced_logprobs(engine.model, prompt, s["output_ids"], 1.2)
        assert max(abs(a - b) for a, b in zip(served, reference, strict=True)) < 1e-4


async def test_a_sampling_seed_fixes_the_tokens_whatever_the_batch(engine: BatchEngine) -> None:
    """Same seed + prompt + weights => same tokens: n samples with one seed are identical (as in
    SGLang), and equal to the same seed alone and to the same seed among other requests."""
    prompt = chat_ids(engine, PROMPT)
    seeded = SamplingParams(max_new_tokens=10, temperature=1.0, sampling_seed=1234)
    alone = await engine.generate(GenerationJob(prompt, seeded))
    crowd = [
        GenerationJob(chat_ids(engine, p), SamplingParams(max_new_tokens=14, temperature=1.0)) for p in ("Hi", "2+2?")
    ]
    together, *_ = await asyncio.gather(
        engine.generate_n(GenerationJob(prompt, seeded.model_copy(update={"n": 3}))),
        *(engine.generate_n(j) for j in crowd),
    )
    assert [o.output_ids for o in together] == [alone.output_ids] * 3
    other_seed = await engine.generate(GenerationJob(prompt, seeded.model_copy(update={"sampling_seed": 99})))
    assert other_seed.output_ids != alone.output_ids


async def test_the_client_returns_n_samples_and_seeded_samples(engine: BatchEngine, model_dir: Path) -> None:
    app = create_app(engine)
    transport = {"http://w": httpx.ASGITransport(app=app)}
    async with InferenceClient(["http://w"], tokenizer_path=model_dir, transports=transport) as client:
        prompt = client.apply_chat_template([{"role": "user", "content": PROMPT}])
        sampling = SamplingParams(max_new_tokens=6, temperature=1.0)
        many = await client.generate_n(prompt, sampling, n=3)
        assert len(many) == 3 and all(g.weight_version == engine.weight_version for g in many)
        assert all(len(g.logprobs) == len(g.output_ids) > 0 for g in many)
        first = await client.generate_seeded(prompt, sampling, seeds=[11, 12, 13])
        again = await client.generate_seeded(prompt, sampling, seeds=[11, 12, 13])
        assert [g.output_ids for g in first] == [g.output_ids for g in again]
        assert len({tuple(g.output_ids) for g in first}) > 1


async def test_n_larger_than_the_batch_is_refused(http: httpx.AsyncClient, engine: BatchEngine) -> None:
    body = {"input_ids": [1, 2], "sampling_params": {"n": engine.max_batch_size + 1, "max_new_tokens": 1}}
    response = await http.post("/generate", json=body)
    assert response.status_code == 400 and "max_batch_size" in response.json()["error"]["message"]


async def test_the_radix_cache_shares_a_prompt_and_keeps_a_finished_turn(
    http: httpx.AsyncClient, engine: BatchEngine
) -> None:
    """Independent requests with one prompt prefill it once; a next turn that resends the first
    turn's prompt and output reuses both, and its logprobs are still teacher-forced ones."""
    assert (await http.post("/flush_cache")).status_code == 200
    prompt = chat_ids(engine, "Name a fruit.")
    body: dict[str, Any] = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 6, "temperature": 0.0}}
    answers = await asyncio.gather(*(http.post("/generate", json=body) for _ in range(3)))
    cached = sorted(a.json()["meta_info"]["cached_tokens"] for a in answers)
    assert cached == [0, len(prompt) - 1, len(prompt) - 1]
    first = answers[0].json()
    follow_up = engine.tokenizer.encode("<|im_start|>user\nAnd a vegetable?<|im_end|>\n<|im_start|>assistant\n")
    second_turn = prompt + first["output_ids"] + [int(t) for t in follow_up]
    body = {
        "input_ids": second_turn,
        "sampling_params": {"max_new_tokens": 6, "temperature": 0.8},
        "return_logprob": True,
    }
    second = (await http.post("/generate", json=body)).json()
    assert second["meta_info"]["cached_tokens"] >= len(prompt) + len(first["output_ids"]) - 1
    served = [lp for lp, _, _ in second["meta_info"]["output_token_logprobs"]]
    reference = teacher_forced_logprobs(engine.model, second_turn, second["output_ids"], 0.8)
    assert max(abs(a - b) for a, b in zip(served, reference, strict=True)) < 1e-4
