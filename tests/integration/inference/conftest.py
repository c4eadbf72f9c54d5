"""Fixtures: the real SmolLM2 model, one batching engine per session, an in-process HTTP client."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import torch

from services.inference.app import create_app
from services.inference.engine import BatchEngine
from services.inference.settings import InferenceSettings
from spade.auth import KeyRing, Principal, hash_key
from spade.inference.models import ensure_default_model, load_model
from tests.conftest import needs

ADMIN_KEY = "inference-test-admin-key"
"""The learner's key in these tests: the admin routes are off on a server without one."""


def admin_settings(**values: object) -> InferenceSettings:
    """Inference settings with :data:`ADMIN_KEY` as the one admin key (generation stays open)."""
    return InferenceSettings(admin_keys=[{"tenant": "learner", "key_sha256": hash_key(ADMIN_KEY)}], **values)  # type: ignore[arg-type]


def admin_ring() -> KeyRing[Principal] | None:
    """The keys of :func:`admin_settings`, for ``create_app(engine, keys=...)``."""
    return admin_settings().keyring()


@pytest.fixture(scope="session")
@needs("model")
def model_dir() -> Path:
    """The default model, converted from the shipped GGUF once (cached across runs)."""
    return ensure_default_model()


@pytest.fixture(scope="session")
def perturbed_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model with every weight matrix nudged by noise: a 'trained' next version."""
    model = load_model(model_dir)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.add_(torch.randn(param.shape, generator=generator) * param.std() * 0.05)
    target = tmp_path_factory.mktemp("ckpt") / "step-1"
    model.save_pretrained(target)
    return target


@pytest.fixture(scope="session")
def engine(model_dir: Path) -> Iterator[BatchEngine]:
    """A started engine shared by the session. Tests that swap weights must swap them back."""
    # One intra-op thread (for the engine's thread only): on a shared 2-core machine, OpenMP threads
    # spinning at barriers make a 2-thread forward pass tens of times slower under load.
    eng = BatchEngine(model_dir, weight_version="0", max_batch_size=16, torch_threads=1)
    eng.start()
    yield eng
    eng.close()


@pytest.fixture
async def http(engine: BatchEngine) -> AsyncIterator[httpx.AsyncClient]:
    """HTTP client to the app over ASGI (the engine is already started), sending the admin key."""
    app = create_app(engine, keys=admin_ring())
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://inference", headers=headers) as client:
        yield client


def chat_ids(engine: BatchEngine, text: str) -> list[int]:
    """Prompt ids of one user message with the model's own chat template."""
    ids = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=False
    )
    return [int(t) for t in ids]  # type: ignore[arg-type]


def teacher_forced_logprobs(
    model: torch.nn.Module, prompt: list[int], output: list[int], temperature: float
) -> list[float]:
    """Logprobs of ``output`` after ``prompt`` from one full forward pass, as a float32 learner computes them."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # see the engine fixture; restored for the rest of the session
    try:
        with torch.no_grad():
            logits = model(torch.tensor([prompt + output])).logits[0].float()
    finally:
        torch.set_num_threads(threads)
    if temperature > 0:
        logits = logits / temperature
    logprobs = torch.log_softmax(logits, dim=-1)
    return [float(logprobs[len(prompt) - 1 + j, tok]) for j, tok in enumerate(output)]
