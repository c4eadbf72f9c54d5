"""The inference server's SPADE side: /healthz, /metrics and the one REST error shape (SGLang's 400 kept)."""

from __future__ import annotations

import httpx


def _error(response: httpx.Response) -> tuple[int, str, str]:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message"}, body
    return response.status_code, body["error"]["code"], body["error"]["message"]


async def test_healthz_and_metrics(http: httpx.AsyncClient) -> None:
    health = await http.get("/healthz")
    assert health.status_code == 200 and health.json()["status"] == "ok"
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
