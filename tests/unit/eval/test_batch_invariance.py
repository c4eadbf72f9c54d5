"""``batch_invariant``: what the eval records and says when the server can or cannot honour it.

SGLang servers cannot run here, so they are httpx.MockTransport answering ``/get_server_info`` in
SGLang 0.5's shape; the embedded server's answer is checked for real in
tests/integration/eval/test_batch_invariance.py.
"""

from __future__ import annotations

import logging

import httpx
import pytest

from services.eval.model import Invariance, Sampling, invariance_of
from services.eval.settings import EvalSettings
from services.eval.wiring import batch_invariance
from spade.inference.client import InferenceClient
from spade.inference.protocol import ServerInfo

SGLANG = ServerInfo(model_path="Qwen/Qwen3-8B", version="0.5.23")
SGLANG_DETERMINISTIC = ServerInfo(model_path="Qwen/Qwen3-8B", version="0.5.23", enable_deterministic_inference=True)
EMBEDDED = ServerInfo(model_path="/m", batch_invariant_requests=True)


@pytest.mark.parametrize(
    ("requested", "servers", "expected"),
    [
        (False, [SGLANG_DETERMINISTIC], Invariance.OFF),
        (True, [SGLANG_DETERMINISTIC], Invariance.SERVER),
        (True, [SGLANG_DETERMINISTIC, SGLANG_DETERMINISTIC], Invariance.SERVER),
        (True, [EMBEDDED], Invariance.PER_REQUEST),
        (True, [EMBEDDED, SGLANG_DETERMINISTIC], Invariance.PER_REQUEST),
        (True, [SGLANG], Invariance.UNSUPPORTED),
        (True, [EMBEDDED, SGLANG], Invariance.UNSUPPORTED),  # one worker that cannot is enough to lose it
        (True, [None], Invariance.UNSUPPORTED),
        (True, [], Invariance.UNSUPPORTED),
    ],
)
def test_invariance_of(requested: bool, servers: list[ServerInfo | None], expected: Invariance) -> None:
    assert invariance_of(requested, servers) is expected


def test_on_by_default_and_recorded_with_the_sampling() -> None:
    assert EvalSettings().batch_invariant is True
    sampling = Sampling(0.6, 1.0, 32, Invariance.UNSUPPORTED)
    assert sampling.to_dict()["batch_invariant"] == "unsupported" and sampling.asks_invariance
    assert not Sampling(0.6, 1.0, 32).asks_invariance


def _client(answer: httpx.Response) -> InferenceClient:
    async def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/get_server_info"
        return answer

    return InferenceClient(["http://sglang:30000"], transports={"http://sglang:30000": httpx.MockTransport(handler)})


@pytest.mark.parametrize(
    ("answer", "expected", "why"),
    [
        (httpx.Response(200, json=SGLANG_DETERMINISTIC.model_dump()), Invariance.SERVER, None),
        (httpx.Response(200, json=SGLANG.model_dump()), Invariance.UNSUPPORTED, "shows neither"),
        (httpx.Response(404, json={"detail": "Not Found"}), Invariance.UNSUPPORTED, "no /get_server_info"),
        (httpx.Response(401, json={"detail": "bad key"}), Invariance.UNSUPPORTED, "answered HTTP 401"),
    ],
)
async def test_a_server_that_cannot_honour_it_is_named_in_the_log(
    answer: httpx.Response, expected: Invariance, why: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="spade.eval"):
        async with _client(answer) as client:
            assert await batch_invariance(client, True) is expected
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    if why is None:
        assert not warnings
        return
    (warning,) = warnings
    assert "http://sglang:30000 cannot honour batch_invariant" in warning and why in warning
    assert "--enable-deterministic-inference" in warning and "SPADE_EVAL_BATCH_INVARIANT=0" in warning


async def test_not_asked_for_asks_nothing() -> None:
    async with _client(httpx.Response(500)) as client:
        assert await batch_invariance(client, False) is Invariance.OFF
