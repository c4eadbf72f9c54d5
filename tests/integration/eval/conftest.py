"""Fixtures: the real SmolLM2 model behind the embedded server on loopback, and the real sandbox pool."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from services.inference.settings import InferenceSettings
from services.inference.wiring import ServerHandle, serve_in_thread
from services.sandbox.isolation import SandboxPool
from services.sandbox.isolation.settings import IsolationSettings
from spade.envs.examples import EXAMPLES
from spade.inference.client import InferenceClient
from spade.inference.models import ensure_default_model
from tests.conftest import needs


@pytest.fixture(scope="session")
@needs("model")
def model_dir() -> Path:
    """The default model, converted from the shipped GGUF once (cached across runs)."""
    return ensure_default_model()


@pytest.fixture(scope="session")
def server(model_dir: Path) -> Iterator[ServerHandle]:
    """The embedded server, as ``spade eval --model DIR`` starts it (one torch thread: a shared CPU)."""
    handle = serve_in_thread(
        InferenceSettings(model_path=model_dir, http={"host": "127.0.0.1", "port": 0}, torch_threads=1)
    )
    yield handle
    handle.stop()


@pytest.fixture
async def client(server: ServerHandle, model_dir: Path) -> AsyncIterator[InferenceClient]:
    async with InferenceClient([server.url], tokenizer_path=model_dir) as c:
        await c.wait_ready()
        yield c


@pytest.fixture
@needs("sandbox")
async def sandbox() -> AsyncIterator[SandboxPool]:
    pool = SandboxPool(IsolationSettings())
    await pool.start()
    try:
        yield pool
    finally:
        await pool.stop()


def game_examples_export(path: Path, count: int = 2) -> Path:
    """An ``envs.jsonl`` at ``path`` holding the first ``count`` game examples, valid, as a pool source."""
    games = [e for e in EXAMPLES.values() if str(getattr(e.setting, "value", e.setting)) == "game"][:count]
    rows = ({"env_id": e.name, "setting": "game", "skill": "Logic", "status": "valid", "code": e.code} for e in games)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path
