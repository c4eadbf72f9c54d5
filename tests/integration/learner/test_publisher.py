"""Weight publishing over real HTTP: embedded inference servers, plus failure-injecting workers.

The embedded server (``services/inference``) is the real worker; the small FastAPI apps below exist
only to inject failures an honest server does not produce on demand (500s, hangs, flakiness).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from services.inference.settings import InferenceSettings
from services.inference.wiring import ServerHandle, serve_in_thread
from services.learner.checkpoint import write_weights
from services.learner.publisher import PublishError, PublishOutcome, WeightPublisher
from services.learner.wiring import build_learner, close_learner
from spade.auth import hash_key
from spade.endpoints import InferenceEndpoint
from spade.inference.client import InferenceClient
from spade.queues.base import WEIGHTS_PUBLISHED
from spade.queues.inprocess import InProcessQueue
from spade.retry import RetryPolicy
from spade.v1 import queues_pb2

from .conftest import SPEC, make_settings
from .test_learner_loop import put_group

QUICK = RetryPolicy(attempts=3, initial_s=0.01, max_s=0.04, jitter_s=0.0)
"""Three rounds (two retry rounds), quickly."""

ADMIN_KEY = "publisher-test-admin-key"
"""The learner's admin key: the embedded servers' admin routes are off without one."""
ADMIN_KEYS = json.dumps([{"tenant": "learner", "key_sha256": hash_key(ADMIN_KEY)}])
AS_LEARNER = InferenceEndpoint.model_validate({"api_key": ADMIN_KEY})


class FakeWorker:
    """A real HTTP server whose weight updates fail on purpose (``mode``: fail, hang, flaky)."""

    def __init__(self, mode: str, fail_times: int = 1) -> None:
        self.calls = 0
        app = FastAPI()

        @app.post("/update_weights_from_disk")
        async def update(body: dict) -> JSONResponse:
            self.calls += 1
            if mode == "hang":
                await asyncio.sleep(30)
            if mode == "fail" or (mode == "flaky" and self.calls <= fail_times):
                return JSONResponse({"detail": "disk on fire"}, status_code=500)
            return JSONResponse({"success": True, "message": f"loaded {body['weight_version']}"})

        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "fake worker did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


class SubprocessWorker:
    """The embedded server as its own process (``spade serve inference``), as in production."""

    def __init__(self, model: Path) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        spade = Path(sys.executable).parent / "spade"
        self.proc = subprocess.Popen(
            [str(spade), "serve", "inference", "--model", str(model), "--port", str(port)],
            env={**os.environ, "SPADE_INFERENCE_ADMIN_KEYS": ADMIN_KEYS},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 120
        while True:
            assert self.proc.poll() is None, "the inference server process exited"
            assert time.monotonic() < deadline, "the inference server did not start"
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def server(base_model: Path) -> Iterator[ServerHandle]:
    """One embedded server in this process (its engine is inspectable)."""
    handle = serve_in_thread(
        InferenceSettings(http={"port": 0}, model_path=base_model, admin_keys=json.loads(ADMIN_KEYS))
    )
    yield handle
    handle.stop()


@pytest.fixture
def remote(base_model: Path) -> Iterator[SubprocessWorker]:
    """A second embedded server in its own process (two engines in one process would load weights
    concurrently in one interpreter, which transformers does not support; see the learner docs)."""
    worker = SubprocessWorker(base_model)
    yield worker
    worker.stop()


@pytest.fixture
def fakes() -> Iterator[dict[str, FakeWorker]]:
    made: dict[str, FakeWorker] = {}
    yield made
    for w in made.values():
        w.stop()


def _changed_weights(base: Path, target: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    write_weights(model, target, base_model_dir=base)
    return {k: v.clone() for k, v in model.state_dict().items()}


async def _announced(queue: InProcessQueue) -> list[queues_pb2.WeightsPublished]:
    got = await queue.consume(WEIGHTS_PUBLISHED, "watch", "w", count=10, block_ms=10)
    return [queues_pb2.WeightsPublished.FromString(d.payload) for d in got]


@pytest.mark.slow
async def test_every_embedded_worker_loads_the_new_version(tmp_path, base_model, server, remote):
    queue = InProcessQueue()
    urls = [server.url, remote.url]
    publisher = WeightPublisher(urls, queue, weights_dir=tmp_path / "w", retry=QUICK, inference=AS_LEARNER)
    target = publisher.version_dir(5)
    expected = _changed_weights(base_model, target)
    result = await publisher.publish(5, target)
    assert result.outcome is PublishOutcome.ALL_ACKNOWLEDGED and not publisher.unhealthy
    async with InferenceClient(urls) as client:
        assert [i.weight_version for i in await client.model_info()] == ["5", "5"]
    served = server.engine.model.state_dict()
    assert all(torch.equal(served[k], v) for k, v in expected.items())
    (msg,) = await _announced(queue)
    assert msg.weight_version == 5 and msg.checkpoint_path == str(target)
    assert sorted(msg.workers_ok) == sorted(urls) and not msg.workers_failed
    await publisher.close()
    await queue.close()


async def test_a_failing_worker_is_retried_reported_unhealthy_and_named(tmp_path, base_model, server, fakes):
    fakes["bad"] = FakeWorker("fail")
    queue = InProcessQueue()
    urls = [server.url, fakes["bad"].url]
    publisher = WeightPublisher(urls, queue, weights_dir=tmp_path / "w", retry=QUICK, inference=AS_LEARNER)
    target = publisher.version_dir(1)
    _changed_weights(base_model, target)
    result = await publisher.publish(1, target)
    assert result.outcome is PublishOutcome.PARTIAL
    assert result.workers_ok == (server.url,) and set(result.workers_failed) == {fakes["bad"].url}
    assert fakes["bad"].calls >= 3  # first round + two retry rounds
    assert set(publisher.unhealthy) == {fakes["bad"].url}
    (msg,) = await _announced(queue)
    assert list(msg.workers_failed) == [fakes["bad"].url] and list(msg.workers_ok) == [server.url]

    strict = WeightPublisher(
        urls, queue, weights_dir=tmp_path / "w", retry=RetryPolicy(attempts=1), require_all=True, inference=AS_LEARNER
    )
    with pytest.raises(PublishError, match="not acknowledged"):
        await strict.publish(2, target)
    (msg,) = await _announced(queue)  # even a refused partial update is announced, never silent
    assert list(msg.workers_failed) == [fakes["bad"].url]
    await publisher.close()
    await strict.close()
    await queue.close()


async def test_hanging_and_flaky_workers(tmp_path, base_model, fakes):
    fakes["hang"] = FakeWorker("hang")
    fakes["flaky"] = FakeWorker("flaky", fail_times=3)
    queue = InProcessQueue()
    publisher = WeightPublisher(
        [fakes["hang"].url, fakes["flaky"].url],
        queue,
        weights_dir=tmp_path / "w",
        retry=QUICK,
        timeout_s=0.3,
    )
    result = await publisher.publish(2, tmp_path / "w" / "v2")
    # The flaky one failed its first round (two tries) and succeeded on a retry round.
    assert result.workers_ok == (fakes["flaky"].url,)
    assert set(result.workers_failed) == {fakes["hang"].url}
    assert (
        "Timeout" in result.workers_failed[fakes["hang"].url]
        or "timed out" in result.workers_failed[fakes["hang"].url].lower()
    )
    assert fakes["flaky"].url not in publisher.unhealthy
    await publisher.close()
    await queue.close()


async def test_learner_publishes_each_step_to_the_embedded_server(tmp_path, base_model, server):
    queue = InProcessQueue()
    settings = make_settings(
        tmp_path, base_model, inference_urls=[server.url], keep_weights=1, inference={"api_key": ADMIN_KEY}
    )
    learner = build_learner(settings, spec=SPEC, queue=queue)
    for step in range(2):
        await put_group(queue, f"e{step}", step, [1, 0, 1, 0])
        report = await learner.run_step()
        assert report.publish is not None and report.publish.outcome is PublishOutcome.ALL_ACKNOWLEDGED
    async with InferenceClient([server.url]) as client:
        assert (await client.model_info())[0].weight_version == "2"
    served = server.engine.model.state_dict()
    live = learner.trainer.model.state_dict()
    assert all(torch.equal(served[k], live[k]) for k in live)
    # Retention: only the newest published version is kept on disk, and `latest` points at it.
    assert sorted(p.name for p in settings.weights_dir.iterdir()) == ["latest", "v00000002"]
    assert (settings.weights_dir / "latest").resolve() == (settings.weights_dir / "v00000002").resolve()
    await close_learner(learner)


async def test_the_embedded_run_s_learner_publishes_with_the_run_s_own_key(tmp_path, base_model):
    """`make run`: the server's admin routes are on only for the key the run made, which its learner
    holds; the designer's and the rollout's settings (no key) are refused there."""
    from services.embedded.roles import role_settings
    from services.embedded.settings import RunSettings
    from services.embedded.system import inference_settings
    from spade.auth import generate_key

    run = RunSettings(run_dir=tmp_path / "run")
    key, digest = generate_key()
    handle = serve_in_thread(inference_settings(run, base_model, digest))
    try:
        roles = role_settings(run, inference_url=handle.url, model=base_model, admin_key=key)
        queue = InProcessQueue()
        publisher = WeightPublisher(
            [handle.url], queue, weights_dir=tmp_path / "w", retry=QUICK, inference=roles.learner.inference
        )
        target = publisher.version_dir(3)
        _changed_weights(base_model, target)
        assert (await publisher.publish(3, target)).outcome is PublishOutcome.ALL_ACKNOWLEDGED
        assert handle.engine.weight_version == "3"
        as_rollout = WeightPublisher(
            [handle.url], queue, weights_dir=tmp_path / "w", retry=QUICK, inference=roles.rollout.inference
        )
        refused = await as_rollout.publish(4, target)
        assert refused.outcome is PublishOutcome.NONE_ACKNOWLEDGED
        assert "401" in refused.workers_failed[handle.url] or "unauth" in refused.workers_failed[handle.url].lower()
        assert handle.engine.weight_version == "3"
        await publisher.close()
        await as_rollout.close()
        await queue.close()
    finally:
        handle.stop()
