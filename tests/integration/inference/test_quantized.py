"""Rounded decode weights (bf16, int8, int4) on the real model: logprobs near the fp32 learner's, every update too."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from services.inference import rows as rows_kernel
from services.inference.engine import BatchEngine, GenerationJob
from services.inference.quant import Bf16Linear, Int4Linear, Int8Linear
from spade.inference.models import load_model
from spade.inference.protocol import SamplingParams
from tests.integration.inference.conftest import chat_ids, teacher_forced_logprobs

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["bf16", "int8", "int4"])
def quantized(model_dir: Path, request: pytest.FixtureRequest) -> Iterator[BatchEngine]:
    eng = BatchEngine(model_dir, max_batch_size=8, torch_threads=1, weights=request.param)
    eng.start()
    yield eng
    eng.close()


async def _greedy(engine: BatchEngine, prompt: list[int]) -> tuple[list[int], list[float]]:
    """A greedy answer computed from scratch (no prefix reused: every answer compared is computed alike)."""
    assert engine.flush_cache()
    out = await engine.generate(_job(prompt, temperature=0.0))
    return out.output_ids, out.output_logprobs


def _job(prompt: list[int], *, temperature: float, seed: int = 3) -> GenerationJob:
    params = SamplingParams(max_new_tokens=24, temperature=temperature, sampling_seed=seed, ignore_eos=True)
    return GenerationJob(prompt, params)


def _first_q_proj(model: Any) -> Any:
    return model.model.layers[0].self_attn.q_proj


async def test_quantized_logprobs_stay_near_the_fp32_models(quantized: BatchEngine, engine: BatchEngine) -> None:
    prompt = chat_ids(engine, "Write one sentence about rivers.")
    out = await quantized.generate(_job(prompt, temperature=0.6))
    reference = teacher_forced_logprobs(engine.model, prompt, out.output_ids, 0.6)
    diffs = [abs(a - b) for a, b in zip(out.output_logprobs, reference, strict=True)]
    # Close enough for truncated importance sampling to correct: its cap is a ratio of 2 (0.69 in logprob).
    assert statistics.fmean(diffs) < 0.15, diffs
    assert sum(d > math.log(2.0) for d in diffs) <= len(diffs) // 10, diffs
    # ... and not fp32's exactness: these are the rounded weights' logprobs, not a float32 model's.
    assert max(diffs) > 1e-3, diffs


async def test_a_weight_update_is_quantized_like_the_first_load(
    quantized: BatchEngine, model_dir: Path, perturbed_dir: Path
) -> None:
    prompt = chat_ids(quantized, "Name three colours.")
    before = await _greedy(quantized, prompt)
    perturbed = load_model(perturbed_dir)
    served_kind = type(_first_q_proj(quantized.model))
    expected = served_kind(_first_q_proj(perturbed)).weight
    try:
        outcome = await quantized.update_weights(perturbed_dir, "1")
        assert outcome.success, outcome.message
        assert not any(isinstance(m, torch.nn.Linear) for m in quantized.model.modules())
        assert served_kind is {"bf16": Bf16Linear, "int8": Int8Linear, "int4": Int4Linear}[quantized.weights]
        assert torch.equal(_first_q_proj(quantized.model).weight, expected)
        assert quantized.weight_version == "1"
        assert await _greedy(quantized, prompt) != before

        # A model handed over already loaded (the embedded learner's path) is quantized too.
        outcome = await quantized.swap_weights(load_model(model_dir), model_dir, "2")
        assert outcome.success, outcome.message
        assert isinstance(_first_q_proj(quantized.model), served_kind)
        assert await _greedy(quantized, prompt) == before
    finally:
        restored = await quantized.update_weights(model_dir, "0")
        assert restored.success, restored.message


async def test_a_conversation_continues_from_its_cached_answer_whatever_the_batch_keeps(
    quantized: BatchEngine,
) -> None:
    # Where bf16 steps multiply natively through the kernel, the shared batch keeps bf16 KV; a finished answer's
    # KV goes into the prefix cache in the model's dtype, and the next turn's prefill continues from it.
    decoder = quantized.decoder
    assert decoder is not None
    native = quantized.weights == "bf16" and decoder.own_attention and rows_kernel.keeps_bf16_kv()
    assert quantized.kv_dtype == (torch.bfloat16 if native else torch.float32)
    prompt = chat_ids(quantized, "Name three colours.")
    assert quantized.flush_cache()
    first = await quantized.generate(_job(prompt, temperature=0.0))
    follow = prompt + first.output_ids + chat_ids(quantized, "And three more.")[1:]
    cached, kv = quantized.prefix_cache.match(follow)
    assert cached == len(prompt) + len(first.output_ids) - 1  # the answer's last token was never fed back
    assert kv is not None
    assert all(k.dtype == v.dtype == torch.float32 for k, v in kv)
    continued = await quantized.generate(_job(follow, temperature=0.0))
    assert continued.cached_tokens == cached
    fresh_ids, fresh_logprobs = await _greedy(quantized, follow)  # nothing reused
    # The reused answer's KV is the answer's (rounded to bf16 where the batch keeps bf16): the first token and
    # its logprob as computing the whole prompt afresh.
    assert continued.output_ids[0] == fresh_ids[0]
    assert abs(continued.output_logprobs[0] - fresh_logprobs[0]) < 0.05


async def test_a_swap_to_a_model_without_the_lean_step_gives_its_batch_the_models_dtype(
    quantized: BatchEngine, model_dir: Path
) -> None:
    # The shared batch's KV dtype is the served step's: a model the lean step does not compute (a hook on a
    # layer) decodes through transformers' forward, which attends to KV of the model's dtype.
    prompt = chat_ids(quantized, "Name three colours.")
    before = await _greedy(quantized, prompt)
    hooked = load_model(model_dir)
    hooked.model.layers[0].mlp.register_forward_hook(lambda *args: None)
    try:
        outcome = await quantized.swap_weights(hooked, model_dir, "7")
        assert outcome.success, outcome.message
        assert quantized.decoder is None and quantized.kv_dtype == torch.float32
        ids, logprobs = await _greedy(quantized, prompt)
        assert len(ids) == len(before[0]) and all(math.isfinite(x) for x in logprobs)
    finally:
        restored = await quantized.update_weights(model_dir, "0")
        assert restored.success, restored.message
    assert quantized.decoder is not None and quantized.kv_dtype == quantized.decoder.kv_dtype
    assert await _greedy(quantized, prompt) == before
