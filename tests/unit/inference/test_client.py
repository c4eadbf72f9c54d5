"""Client behaviour that needs failing servers: retries, backoff, worker choice, bounds.

A real SGLang server cannot run here, so these use httpx.MockTransport answering in SGLang 0.5's
shapes; the same client calls run against the embedded server in tests/integration/inference.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Callable, Coroutine
from typing import Any

import httpx
import pytest

from spade.inference.client import (
    FinishReason,
    InferenceClient,
    InferenceRequestError,
    InferenceUnavailable,
)
from spade.inference.protocol import SamplingParams
from spade.retry import RetryPolicy

Handler = Callable[[httpx.Request], Coroutine[Any, Any, httpx.Response]]


def _answer(request: httpx.Request, version: str = "1") -> httpx.Response:
    body = json.loads(request.content)
    ids = [t + 1 for t in body["input_ids"][-2:]]
    return httpx.Response(
        200,
        json={
            "text": "ok",
            "output_ids": ids,
            "meta_info": {
                "id": "r",
                "finish_reason": {"type": "length", "length": len(ids)},
                "prompt_tokens": len(body["input_ids"]),
                "completion_tokens": len(ids),
                "weight_version": version,
                "output_token_logprobs": [[-1.0, t, None] for t in ids],
            },
        },
    )


def _client(handlers: dict[str, Handler], **kwargs: object) -> InferenceClient:
    transports = {url: httpx.MockTransport(h) for url, h in handlers.items()}
    kwargs.setdefault("retry", RetryPolicy(attempts=5, initial_s=0.001, max_s=0.001, jitter_s=0.0))
    return InferenceClient(list(handlers), transports=transports, **kwargs)  # type: ignore[arg-type]


async def test_generate_sends_sglang_fields_and_reads_the_answer() -> None:
    seen: list[dict] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/generate"
        seen.append(json.loads(request.content))
        return _answer(request)

    async with _client({"http://w0": handler}) as client:
        gen = await client.generate([5, 6, 7], SamplingParams(max_new_tokens=2, temperature=0.6))
    assert seen[0]["input_ids"] == [5, 6, 7] and seen[0]["return_logprob"] is True
    assert seen[0]["sampling_params"]["temperature"] == 0.6
    assert gen.output_ids == [7, 8] and gen.logprobs == [-1.0, -1.0]
    assert gen.finish_reason is FinishReason.LENGTH and gen.weight_version == "1" and gen.server == "http://w0"


async def test_5xx_is_retried_on_another_worker() -> None:
    calls: Counter[str] = Counter()

    async def broken(request: httpx.Request) -> httpx.Response:
        calls["w0"] += 1
        return httpx.Response(503, json={"error": {"message": "overloaded"}})

    async def healthy(request: httpx.Request) -> httpx.Response:
        calls["w1"] += 1
        return _answer(request)

    async with _client({"http://w0": broken, "http://w1": healthy}) as client:
        for _ in range(4):
            gen = await client.generate([1, 2])
            assert gen.server == "http://w1"
    assert calls["w1"] == 4 and calls["w0"] >= 1


async def test_connection_errors_are_retried_until_the_budget_is_spent() -> None:
    attempts = 0

    async def refused(request: httpx.Request) -> httpx.Response:
        nonlocal attempts
        attempts += 1
        raise httpx.ConnectError("connection refused", request=request)

    async with _client({"http://w0": refused}, retry=RetryPolicy(attempts=4, initial_s=0.001, max_s=0.001)) as client:
        with pytest.raises(InferenceUnavailable, match="4 tries"):
            await client.generate([1])
    assert attempts == 4


async def test_a_transient_failure_then_success() -> None:
    answers = iter([httpx.Response(500, text="boom"), None])

    async def flaky(request: httpx.Request) -> httpx.Response:
        return next(answers) or _answer(request)

    async with _client({"http://w0": flaky}) as client:
        assert (await client.generate([3])).output_ids == [4]


async def test_4xx_is_not_retried() -> None:
    attempts = 0

    async def rejecting(request: httpx.Request) -> httpx.Response:
        nonlocal attempts
        attempts += 1
        return httpx.Response(400, json={"error": {"message": "input too long"}})

    async with _client({"http://w0": rejecting}) as client:
        with pytest.raises(InferenceRequestError, match="input too long") as info:
            await client.generate([1])
    assert attempts == 1 and info.value.status == 400


async def test_concurrency_is_bounded() -> None:
    active = peak = 0

    async def slow(request: httpx.Request) -> httpx.Response:
        nonlocal active, peak
        active += 1
        peak = max(peak, active)
        await asyncio.sleep(0.01)
        active -= 1
        return _answer(request)

    async with _client({"http://w0": slow, "http://w1": slow}, max_concurrency=3) as client:
        results = await asyncio.gather(*(client.generate([i]) for i in range(12)))
    assert len(results) == 12 and peak <= 3
    assert {r.server for r in results} == {"http://w0", "http://w1"}


async def test_weight_updates_report_every_worker() -> None:
    bodies: list[dict] = []

    async def ok(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(200, json={"success": True, "message": "done", "num_paused_requests": 2})

    async def bad(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"success": False, "message": "no such dir", "num_paused_requests": 0})

    async with _client({"http://w0": ok, "http://w1": bad}) as client:
        results = await client.update_weights_from_disk("/ckpt/step-3", "3")
    assert bodies == [
        {"model_path": "/ckpt/step-3", "weight_version": "3", "abort_all_requests": False, "flush_cache": True}
    ]
    assert [(r.url, r.success, r.message) for r in results] == [
        ("http://w0", True, "done"),
        ("http://w1", False, "no such dir"),
    ]
    assert results[0].num_paused_requests == 2


async def test_wait_ready_polls_health_generate() -> None:
    answers = iter([503, 503, 200])

    async def starting(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/health_generate"
        return httpx.Response(next(answers))

    async with _client({"http://w0": starting}) as client:
        await client.wait_ready(timeout_s=5, poll_s=0.001)


async def test_wait_ready_gives_up_with_the_last_error() -> None:
    async def down(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503)

    async with _client({"http://w0": down}) as client:
        with pytest.raises(InferenceUnavailable, match="HTTP 503"):
            await client.wait_ready(timeout_s=0.05, poll_s=0.01)


def test_configuration_errors_are_explained() -> None:
    with pytest.raises(ValueError, match="at least one server URL"):
        InferenceClient([])
    with pytest.raises(ValueError, match="max_concurrency"):
        InferenceClient(["http://w0"], max_concurrency=0)
