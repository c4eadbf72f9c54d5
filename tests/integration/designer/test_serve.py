"""``spade serve designer`` as its own process: SIGTERMed mid-round it exits within its bound (the
grace, not the 900 s round deadline), and every attempt it finished is published and recorded; with a
setting that contradicts the stored run spec it refuses to start, naming the variable.

The pool designer needs no inference server, so the whole service runs here for real: the memory
and the sandbox over gRPC on loopback, the queue on the real Redis, the run spec stored from the
designer's own spec file.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from services.memory.settings import MemorySettings
from services.memory.wiring import serving as memory_serving
from services.sandbox.settings import SandboxSettings
from services.sandbox.wiring import serving as sandbox_serving
from spade.queues.base import SAMPLES_DESIGNER
from spade.queues.config import RedisQueueConfig
from spade.queues.redis_streams import RedisStreamQueue
from spade.runspec import RunSpec
from spade.v1 import queues_pb2
from tests.conftest import REDIS_URL

pytestmark = [pytest.mark.slow, pytest.mark.redis]

ROOT = Path(__file__).resolve().parents[3]
FIXTURES = ROOT / "tests" / "fixtures" / "designer_pool" / "game"
GRACE_S = 20.0


async def test_sigterm_mid_round_exits_within_the_grace_and_keeps_finished_attempts(tmp_path: Path) -> None:
    pool = tmp_path / "pool"
    shutil.copytree(FIXTURES, pool)
    answers = len(list(pool.glob("*.md")))
    spec_file = tmp_path / "spec.yaml"
    spec = RunSpec(envs_per_round=answers, skills_per_round=3, designer_max_new_tokens=2048)
    spec_file.write_text(spec.to_json())
    prefix = f"test-designer-term-{uuid.uuid4().hex[:8]}:"
    memory_settings = MemorySettings.model_validate(
        {
            "database_url": f"sqlite:///{tmp_path / 'memory.db'}",
            "dev_mode": True,
            "grpc": {"port": 0},
            "http": {"port": 0},
        }
    )
    sandbox_settings = SandboxSettings.model_validate({"grpc": {"port": 0}, "http": {"port": 0}, "dev_mode": True})
    queue = RedisStreamQueue(RedisQueueConfig(url=REDIS_URL, prefix=prefix))
    log_path = tmp_path / "designer.log"
    proc: subprocess.Popen[bytes] | None = None
    try:
        async with memory_serving(memory_settings) as memory, sandbox_serving(sandbox_settings) as sandbox:
            env = {
                **os.environ,
                "SPADE_DESIGNER_DEV_MODE": "true",
                "SPADE_DESIGNER_SETTING": "game",
                "SPADE_DESIGNER_CONCURRENCY": "1",  # one answer at a time: the round lasts long enough
                "SPADE_DESIGNER_GRACE_S": str(GRACE_S),
                "SPADE_DESIGNER_SANDBOX__TARGET": f"127.0.0.1:{sandbox.grpc_port}",
                "SPADE_DESIGNER_MEMORY__TARGET": f"127.0.0.1:{memory.grpc.port}",
                "SPADE_DESIGNER_QUEUE__URL": REDIS_URL,
                "SPADE_DESIGNER_QUEUE__PREFIX": prefix,
            }
            with log_path.open("wb") as log:
                proc = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "spade.cli",
                        "serve",
                        "designer",
                        "--pool",
                        str(pool),
                        "--spec",
                        str(spec_file),
                    ],
                    cwd=ROOT,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
                deadline = time.monotonic() + 300
                while await queue.length(SAMPLES_DESIGNER) < 2:  # mid-round: some answers finished
                    assert proc.poll() is None, log_path.read_text()
                    assert time.monotonic() < deadline, "the designer published nothing: " + log_path.read_text()
                    await asyncio.sleep(0.2)
                os.kill(proc.pid, signal.SIGTERM)
                # Bounded: the grace for the answer being validated, plus the process's own exit.
                code = await asyncio.to_thread(proc.wait, GRACE_S + 30)
            text = log_path.read_text()
            assert code == 0, text
            assert "ended by a stop request" in text, text

            published = []
            while batch := await queue.consume(SAMPLES_DESIGNER, "test", "t", count=100, block_ms=200):
                published += [queues_pb2.DesignerSample.FromString(d.payload) for d in batch]
            assert 2 <= len(published) < answers  # cut short, finished work kept
            assert not any(s.trainable for s in published) and {s.spec_id for s in published} == {spec.spec_id}
            # Every published attempt is in the memory's figures, and the spec file was stored.
            stats = await memory.app.service.stats()
            assert stats.attempts.attempts == len(published)
            assert (await memory.app.service.get_run_spec()).spec_id == spec.spec_id
            # One structured line per attempt.
            assert text.count("designer attempt ") == len(published), text
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)
        import redis.asyncio as redis

        client = redis.from_url(REDIS_URL)
        keys = [key async for key in client.scan_iter(match=f"{prefix}*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()
        await queue.close()


async def test_a_setting_contradicting_the_stored_spec_refuses_to_start_naming_it(tmp_path: Path) -> None:
    spec = RunSpec(envs_per_round=6, skills_per_round=3, designer_max_new_tokens=2048)
    memory_settings = MemorySettings.model_validate(
        {
            "database_url": f"sqlite:///{tmp_path / 'memory.db'}",
            "dev_mode": True,
            "grpc": {"port": 0},
            "http": {"port": 0},
        }
    )
    sandbox_settings = SandboxSettings.model_validate({"grpc": {"port": 0}, "http": {"port": 0}, "dev_mode": True})
    async with memory_serving(memory_settings) as memory, sandbox_serving(sandbox_settings) as sandbox:
        await memory.app.service.set_run_spec(spec)  # `spade runspec set FILE` did this
        env = {
            **os.environ,
            "SPADE_DESIGNER_DEV_MODE": "true",
            "SPADE_DESIGNER_ENVS_PER_ROUND": "5",
            "SPADE_DESIGNER_TEMPERATURE": "0.6",  # agrees with the spec: not named
            "SPADE_DESIGNER_SANDBOX__TARGET": f"127.0.0.1:{sandbox.grpc_port}",
            "SPADE_DESIGNER_MEMORY__TARGET": f"127.0.0.1:{memory.grpc.port}",
            "SPADE_DESIGNER_QUEUE__URL": REDIS_URL,
            "SPADE_DESIGNER_QUEUE__PREFIX": f"test-designer-refuse-{uuid.uuid4().hex[:8]}:",
        }
        done = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "spade.cli", "serve", "designer", "--pool", str(FIXTURES)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert done.returncode == 2, done.stdout + done.stderr
    refusal = [line for line in done.stderr.splitlines() if line.startswith("  ")]
    assert len(refusal) == 1, done.stderr
    assert refusal[0].strip().startswith("SPADE_DESIGNER_ENVS_PER_ROUND: envs_per_round: this service is configured")
    assert "run spec has 6" in refusal[0] and "Traceback" not in done.stderr


async def test_waiting_for_the_run_spec_is_logged_and_sigterm_ends_the_wait(tmp_path: Path) -> None:
    memory_settings = MemorySettings.model_validate(
        {
            "database_url": f"sqlite:///{tmp_path / 'memory.db'}",
            "dev_mode": True,
            "grpc": {"port": 0},
            "http": {"port": 0},
        }
    )
    sandbox_settings = SandboxSettings.model_validate({"grpc": {"port": 0}, "http": {"port": 0}, "dev_mode": True})
    log_path = tmp_path / "designer.log"
    async with memory_serving(memory_settings) as memory, sandbox_serving(sandbox_settings) as sandbox:
        env = {
            **os.environ,
            "SPADE_DESIGNER_DEV_MODE": "true",
            "SPADE_DESIGNER_WAIT_LOG_S": "1",
            "SPADE_DESIGNER_SANDBOX__TARGET": f"127.0.0.1:{sandbox.grpc_port}",
            "SPADE_DESIGNER_MEMORY__TARGET": f"127.0.0.1:{memory.grpc.port}",
            "SPADE_DESIGNER_QUEUE__URL": REDIS_URL,
            "SPADE_DESIGNER_QUEUE__PREFIX": f"test-designer-wait-{uuid.uuid4().hex[:8]}:",
        }
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "spade.cli", "serve", "designer", "--pool", str(FIXTURES)],
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            try:
                deadline = time.monotonic() + 300
                while log_path.read_text().count("waiting for a run spec in the memory") < 2:  # said, and repeated
                    assert proc.poll() is None, log_path.read_text()
                    assert time.monotonic() < deadline, log_path.read_text()
                    await asyncio.sleep(0.2)
                os.kill(proc.pid, signal.SIGTERM)
                code = await asyncio.to_thread(proc.wait, 60)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(10)
    text = log_path.read_text()
    assert code == 0, text
    assert "designer waiting for a run spec in the memory" in text and " s so far" in text
    assert "spade runspec set FILE" in text
    assert "stopped while waiting for a run spec" in text and "Traceback" not in text
