"""/update_weights_from_disk on the real model: a changed checkpoint changes outputs, logprobs and version;
requests in flight finish on the old weights; a bad checkpoint changes nothing."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from services.inference.engine import BatchEngine, GenerationJob
from spade.inference.models import load_model
from spade.inference.protocol import SamplingParams
from tests.integration.inference.conftest import chat_ids, teacher_forced_logprobs

pytestmark = pytest.mark.slow


async def _wait_until(done: Callable[[], object], what: str) -> None:
    for _ in range(2000):
        if done():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{what} never happened")


async def test_update_swaps_weights_and_version(
    http: httpx.AsyncClient, engine: BatchEngine, model_dir: Path, perturbed_dir: Path
) -> None:
    prompt = chat_ids(engine, "Write one sentence about rivers.")
    body = {"input_ids": prompt, "sampling_params": {"temperature": 0.0, "max_new_tokens": 10}, "return_logprob": True}
    old_version = engine.weight_version
    before = (await http.post("/generate", json=body)).json()
    assert before["meta_info"]["weight_version"] == old_version
    try:
        response = await http.post(
            "/update_weights_from_disk", json={"model_path": str(perturbed_dir), "weight_version": "7"}
        )
        assert response.status_code == 200, response.text
        assert response.json()["success"] is True

        after = (await http.post("/generate", json=body)).json()
        assert after["meta_info"]["weight_version"] == "7"
        before_lp = [lp for lp, _, _ in before["meta_info"]["output_token_logprobs"]]
        after_lp = [lp for lp, _, _ in after["meta_info"]["output_token_logprobs"]]
        changed = before["output_ids"] != after["output_ids"] or any(
            abs(a - b) > 1e-2 for a, b in zip(before_lp, after_lp, strict=True)
        )
        assert changed, "the new weights did not change the outputs"
        # ... and the new logprobs are the new model's, exactly.
        reference = teacher_forced_logprobs(engine.model, prompt, after["output_ids"], 0.0)
        assert max(abs(a - b) for a, b in zip(after_lp, reference, strict=True)) < 1e-4

        info = (await http.get("/model_info")).json()
        assert info["weight_version"] == "7"
        assert info["model_path"] == str(perturbed_dir)
    finally:
        restore = await engine.update_weights(model_dir, "0")
        assert restore.success, restore.message


async def test_in_flight_requests_finish_on_the_old_weights_and_new_ones_wait(
    engine: BatchEngine, model_dir: Path, perturbed_dir: Path
) -> None:
    prompt = chat_ids(engine, "Tell me about the moon.")
    old_model, old_version = engine.model, engine.weight_version
    new_model = load_model(perturbed_dir)
    # Long enough to be still decoding once the new weights are prepared (float32's transposed copies).
    in_flight = asyncio.create_task(
        engine.generate(GenerationJob(prompt, SamplingParams(max_new_tokens=96, temperature=1.0, ignore_eos=True)))
    )
    await _wait_until(lambda: engine.num_running, "the in-flight request's start")
    try:
        swap = asyncio.create_task(engine.swap_weights(new_model, perturbed_dir, "8"))
        await _wait_until(lambda: engine.swap_pending, "the swap")  # weights prepared: admission stopped
        later = asyncio.create_task(engine.generate(GenerationJob(prompt, SamplingParams(max_new_tokens=4))))
        outcome = await swap
        assert outcome.success and outcome.num_paused_requests == 1

        drained = await in_flight
        assert drained.weight_version == old_version and len(drained.output_ids) == 96
        reference = teacher_forced_logprobs(old_model, prompt, drained.output_ids, 1.0)
        assert max(abs(a - b) for a, b in zip(drained.output_logprobs, reference, strict=True)) < 1e-4

        waited = await later
        assert waited.weight_version == "8"
        reference = teacher_forced_logprobs(new_model, prompt, waited.output_ids, 1.0)
        assert max(abs(a - b) for a, b in zip(waited.output_logprobs, reference, strict=True)) < 1e-4
    finally:
        restore = await engine.update_weights(model_dir, "0")
        assert restore.success, restore.message


async def test_a_bad_checkpoint_keeps_the_current_weights(
    http: httpx.AsyncClient, engine: BatchEngine, tmp_path: Path
) -> None:
    version, model = engine.weight_version, engine.model
    response = await http.post(
        "/update_weights_from_disk", json={"model_path": str(tmp_path / "nope"), "weight_version": "9"}
    )
    assert response.status_code == 400
    body = response.json()
    assert body["success"] is False and "nope" in body["message"]
    assert engine.weight_version == version and engine.model is model
    out = await engine.generate(GenerationJob([1, 2, 3], SamplingParams(max_new_tokens=2)))
    assert out.weight_version == version


async def test_abort_all_requests_aborts_in_flight_work(engine: BatchEngine, model_dir: Path) -> None:
    prompt = chat_ids(engine, "Tell me a long story.")
    task = asyncio.create_task(
        engine.generate(GenerationJob(prompt, SamplingParams(max_new_tokens=200, ignore_eos=True)))
    )
    await _wait_until(lambda: engine.num_running, "the in-flight request's start")
    outcome = await engine.update_weights(model_dir, "0-reloaded", abort_all_requests=True)
    assert outcome.success
    aborted = await task
    assert aborted.finish_reason["type"] == "abort"
    assert len(aborted.output_ids) < 200
    restore = await engine.update_weights(model_dir, "0")
    assert restore.success
