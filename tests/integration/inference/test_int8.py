"""Int8 decode weights on the real model: logprobs near the fp32 learner's, and every weight update quantized."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from services.inference.engine import BatchEngine, GenerationJob
from services.inference.quant import Int8Linear, quantize_rows
from spade.inference.models import load_model
from spade.inference.protocol import SamplingParams
from tests.integration.inference.conftest import chat_ids, teacher_forced_logprobs

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def int8_engine(model_dir: Path) -> Iterator[BatchEngine]:
    eng = BatchEngine(model_dir, max_batch_size=8, torch_threads=1, weights="int8")
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


async def test_int8_logprobs_stay_near_the_fp32_models(int8_engine: BatchEngine, engine: BatchEngine) -> None:
    prompt = chat_ids(engine, "Write one sentence about rivers.")
    out = await int8_engine.generate(_job(prompt, temperature=0.6))
    reference = teacher_forced_logprobs(engine.model, prompt, out.output_ids, 0.6)
    diffs = [abs(a - b) for a, b in zip(out.output_logprobs, reference, strict=True)]
    # Close enough for truncated importance sampling to correct: its cap is a ratio of 2 (0.69 in logprob).
    assert statistics.fmean(diffs) < 0.15, diffs
    assert sum(d > math.log(2.0) for d in diffs) <= len(diffs) // 10, diffs
    # ... and not fp32's exactness: these are the int8 weights' logprobs, not a float32 model's.
    assert max(diffs) > 1e-3, diffs


async def test_a_weight_update_is_quantized_like_the_first_load(
    int8_engine: BatchEngine, model_dir: Path, perturbed_dir: Path
) -> None:
    prompt = chat_ids(int8_engine, "Name three colours.")
    before = await _greedy(int8_engine, prompt)
    perturbed = load_model(perturbed_dir)
    expected, _ = quantize_rows(_first_q_proj(perturbed).weight)
    try:
        outcome = await int8_engine.update_weights(perturbed_dir, "1")
        assert outcome.success, outcome.message
        assert not any(isinstance(m, torch.nn.Linear) for m in int8_engine.model.modules())
        assert torch.equal(_first_q_proj(int8_engine.model).qweight, expected)
        assert int8_engine.weight_version == "1"
        assert await _greedy(int8_engine, prompt) != before

        # A model handed over already loaded (the embedded learner's path) is quantized too.
        outcome = await int8_engine.swap_weights(load_model(model_dir), model_dir, "2")
        assert outcome.success, outcome.message
        assert isinstance(_first_q_proj(int8_engine.model), Int8Linear)
        assert await _greedy(int8_engine, prompt) == before
    finally:
        restored = await int8_engine.update_weights(model_dir, "0")
        assert restored.success, restored.message
