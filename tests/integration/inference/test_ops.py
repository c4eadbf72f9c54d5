"""The inference server's SPADE side: /healthz, /metrics and the one REST error shape (SGLang's 400 kept)."""

from __future__ import annotations

import asyncio
import gc
import os
import time
import weakref
from pathlib import Path

import httpx
import pytest

from services.inference.app import create_app
from services.inference.engine import BatchEngine, EngineClosed, GenerationJob, TokenEvent
from spade.inference.protocol import SamplingParams


def _error(response: httpx.Response) -> tuple[int, str, str]:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message"}, body
    return response.status_code, body["error"]["code"], body["error"]["message"]


async def test_healthz_and_metrics(http: httpx.AsyncClient) -> None:
    health = await http.get("/healthz", headers={"Authorization": ""})
    assert (health.status_code, health.text) == (200, "ok")  # the details, with a key: test_admin_routes.py
    await http.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}})
    metrics = (await http.get("/metrics")).text
    assert "spade_inference_up 1.0" in metrics and "spade_inference_waiting" in metrics
    assert 'spade_inference_http_requests_total{code="200",route="/generate"}' in metrics


async def test_errors_have_the_one_shape(http: httpx.AsyncClient) -> None:
    status, code, message = _error(await http.post("/generate", json={"text": ""}))
    assert (status, code) == (400, "invalid_request") and "non-empty prompt" in message
    status, code, message = _error(await http.post("/generate", json={"input_ids": "not ids"}))
    assert (status, code) == (400, "invalid_request") and "input_ids" in message
    assert _error(await http.get("/nope"))[:2] == (404, "not_found")


def _work(text: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        sample.name.removeprefix("spade_inference_").removesuffix("_total"): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("spade_inference_") and sample.name.endswith("_total") and not sample.labels
    }


async def test_metrics_count_the_engines_work(http: httpx.AsyncClient) -> None:
    """The work counters grow by exactly what a request did: one prefill for n samples, its prompt
    tokens computed or reused, its generated tokens, and scheduler time for it."""
    before = _work((await http.get("/metrics")).text)
    prompt = list(range(100, 140))
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 5, "n": 3, "temperature": 1.0}}
    response = await http.post("/generate", json=body)
    assert response.status_code == 200, response.text
    answers = response.json()
    assert isinstance(answers, list) and len(answers) == 3
    after = _work((await http.get("/metrics")).text)
    grew = {name: after[name] - before.get(name, 0.0) for name in after}
    assert grew["prefills"] == 1
    assert grew["prompt_tokens"] + grew["cached_tokens"] == len(prompt)
    assert grew["generated_tokens"] == sum(a["meta_info"]["completion_tokens"] for a in answers)
    assert grew["decode_steps"] >= 1 and grew["decode_rows"] >= grew["decode_steps"]
    assert grew["busy_seconds"] > 0
    assert grew["prefill_seconds"] + grew["decode_seconds"] <= grew["busy_seconds"] + 1e-6


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


async def test_an_idle_scheduler_gives_its_openmp_workers_back(model_dir: Path) -> None:
    """Once it has nothing to do, the scheduler frees its OpenMP pool (spade.openmp): an idle pool would cut
    every other pool's spinning short."""
    engine = BatchEngine(model_dir, torch_threads=2)  # the scheduler and one OpenMP worker beside it
    engine.start()
    try:
        idle = _threads()  # the scheduler's thread is running; it has no OpenMP pool before its first work
        job = GenerationJob(list(range(100, 300)), SamplingParams(max_new_tokens=8, ignore_eos=True))
        busy = idle
        async for event in engine.stream(job):
            if isinstance(event, TokenEvent):
                busy = max(busy, _threads())
        deadline = time.monotonic() + 10.0
        while _threads() > idle and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert busy > idle  # the worker existed while it generated
        assert _threads() == idle
    finally:
        engine.close()


async def test_a_closed_engine_lets_its_weights_go_though_its_app_outlives_it(model_dir: Path) -> None:
    """FastAPI keeps the endpoints it has served for the life of the process, and they close over the engine:
    once closed, the engine must not keep its model (every embedded run in a process kept one before)."""
    engine = BatchEngine(model_dir, torch_threads=1)
    app = create_app(engine)
    engine.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine") as http:
            served = await http.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})
            assert served.status_code == 200
        model = weakref.ref(engine.model)
    finally:
        engine.close()
    gc.collect()
    assert model() is None  # the app and the engine object are still here; the weights are not
    engine.close()  # closing again is harmless
    engine.start()  # and a closed engine stays closed
    assert not engine.running
    with pytest.raises(EngineClosed):
        await engine.generate(GenerationJob([1, 2], SamplingParams(max_new_tokens=1)))
    outcome = await engine.update_weights(model_dir)
    assert not outcome.success and "not running" in outcome.message
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine") as http:
        assert (await http.get("/health")).status_code == 503  # the app still answers, for a closed engine
