"""The sandbox's and the inference server's ``stopped`` lines say what the stop finished (issue 23).

Each service runs as ``spade serve`` runs it (``run_until_signalled`` around its ``serve_forever``),
gets a real SIGTERM, and its JSON log is read back.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

from spade.envs.examples import EXAMPLES
from spade.serving import logs
from spade.serving.run import run_until_signalled

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def lines_of(
    serve: Callable[[asyncio.Event], Awaitable[None]],
    service: str,
    work: Callable[[dict[str, Any]], Awaitable[None]],
) -> list[dict[str, Any]]:
    """Run ``serve``; once it has said ``started``, do ``work`` against it (given the started line),
    then send SIGTERM; its JSON log lines."""
    out = io.StringIO()
    logs.configure(service, stream=out)

    def started() -> dict[str, Any] | None:
        lines = [json.loads(line) for line in out.getvalue().splitlines() if line.startswith("{")]
        return next((x for x in lines if x.get("event") == "started"), None)

    async def main(stop: asyncio.Event) -> None:
        async def term_once_started() -> None:
            while (line := started()) is None:
                await asyncio.sleep(0.05)
            await work(line)
            os.kill(os.getpid(), signal.SIGTERM)

        killer = asyncio.create_task(term_once_started())
        try:
            await serve(stop)
        finally:
            killer.cancel()

    try:
        run_until_signalled(main)
    finally:
        logs.reset()
    return [json.loads(line) for line in out.getvalue().splitlines() if line.startswith("{")]


@pytest.mark.sandbox
def test_the_sandbox_says_how_many_sessions_its_stop_closed() -> None:
    from services.sandbox.settings import SandboxSettings
    from services.sandbox.wiring import serve_forever

    settings = SandboxSettings(
        dev_mode=True, grpc={"host": "127.0.0.1", "port": 0}, http={"host": "127.0.0.1", "port": 0}
    )

    async def open_two_sessions(started: dict[str, Any]) -> None:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{started['http_port']}", timeout=60) as http:
            for seed in (1, 2):
                body = {"code": EXAMPLES["number_hunt"].code, "setting": "game", "seed": seed}
                assert (await http.post("/v1/sessions", json=body)).status_code == 201

    lines = lines_of(lambda stop: serve_forever(settings, stop), "sandbox", open_two_sessions)
    stopped = [x for x in lines if x.get("event") == "stopped"]
    assert stopped and stopped[-1]["signal"] == "SIGTERM"
    assert stopped[-1]["finished"] == {"sessions_closed": 2}
    assert stopped[-1]["message"].startswith("sandbox stopped, on SIGTERM")


@pytest.mark.model
def test_the_inference_server_says_what_it_served_and_cut_short() -> None:
    from services.inference.settings import InferenceSettings
    from services.inference.wiring import serve_forever
    from spade.inference.models import ensure_default_model

    settings = InferenceSettings(model_path=ensure_default_model(), http={"host": "127.0.0.1", "port": 0})

    async def generate_once(started: dict[str, Any]) -> None:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{started['port']}", timeout=120) as http:
            body = {
                "input_ids": [1, 2, 3],
                "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
            }
            assert (await http.post("/generate", json=body)).status_code == 200

    lines = lines_of(lambda stop: serve_forever(settings, stop), "inference", generate_once)
    stopped = [x for x in lines if x.get("event") == "stopped"]
    assert stopped and stopped[-1]["signal"] == "SIGTERM"
    assert stopped[-1]["finished"] == {"requests_served": 1, "generated_tokens": 4, "requests_cut_short": 0}
    assert stopped[-1]["message"].startswith("inference stopped at weight version ")
