"""The inference server's admin routes, attacked for real (issue 20): least privilege.

- without admin keys, ``/update_weights_from_disk`` and ``/flush_cache`` are off: 403 for every
  caller, with or without a key, on loopback too, and the start says so in a warning;
- with admin keys, no key or an unknown one is 401, a known generation key 403, the admin key works;
- unauthenticated ``/healthz`` is the bare word ``ok``; ``/healthz/details`` and ``/metrics`` need a key.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from services.inference.app import create_app
from services.inference.engine import BatchEngine
from services.inference.settings import InferenceSettings
from services.inference.wiring import build_app
from spade.auth import hash_key

USER_KEY, ADMIN_KEY = "rollout-generation-key", "learner-admin-key"
ADMIN_CALLS = (
    ("POST", "/update_weights_from_disk", {"model_path": "/nonexistent", "weight_version": "99"}),
    ("POST", "/flush_cache", None),
    ("GET", "/flush_cache", None),
)


async def _client(app: object) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=transport, base_url="http://inference") as client:
        yield client


@pytest.fixture
async def unadministered(engine: BatchEngine) -> AsyncIterator[httpx.AsyncClient]:
    """A server started as `spade serve inference` starts by default: no key of any kind."""
    async for client in _client(create_app(engine, keys=InferenceSettings().keyring())):
        yield client


@pytest.fixture
async def keyed(engine: BatchEngine) -> AsyncIterator[httpx.AsyncClient]:
    """A server with a generation key (the rollout's) and an admin key (the learner's)."""
    settings = InferenceSettings(
        api_keys=[{"tenant": "rollout", "key_sha256": hash_key(USER_KEY)}],
        admin_keys=[{"tenant": "learner", "key_sha256": hash_key(ADMIN_KEY)}],
    )
    async for client in _client(create_app(engine, keys=settings.keyring())):
        yield client


def _bearer(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


async def test_without_admin_keys_the_admin_routes_are_off_for_everyone(
    unadministered: httpx.AsyncClient, engine: BatchEngine
) -> None:
    version = engine.weight_version
    for method, path, body in ADMIN_CALLS:
        for key in (None, "anything", ADMIN_KEY):
            response = await unadministered.request(method, path, json=body, headers=_bearer(key))
            assert response.status_code == 403, (method, path, key, response.text)
            error = response.json()["error"]
            assert error["code"] == "forbidden" and "SPADE_INFERENCE_ADMIN_KEYS" in error["message"]
    assert engine.weight_version == version  # nothing was swapped
    # Generation stays open on a server without keys (loopback: the embedded run's own).
    generated = await unadministered.post(
        "/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}
    )
    assert generated.status_code == 200


async def test_a_generation_key_gets_403_no_key_401_and_the_admin_key_works(keyed: httpx.AsyncClient) -> None:
    for method, path, body in ADMIN_CALLS:
        for key, status in ((None, 401), ("not-a-key", 401), (USER_KEY, 403)):
            response = await keyed.request(method, path, json=body, headers=_bearer(key))
            assert response.status_code == status, (method, path, key, response.text)
        refused = (await keyed.request(method, path, json=body, headers=_bearer(USER_KEY))).json()["error"]
        assert "'rollout' has the write role; changing the server needs admin" in refused["message"]
    # The learner's key reaches the routes (a bad path is SGLang's own 400, not a refusal).
    assert (await keyed.post("/flush_cache", headers=_bearer(ADMIN_KEY))).status_code == 200
    bad = await keyed.post("/update_weights_from_disk", json=ADMIN_CALLS[0][2], headers=_bearer(ADMIN_KEY))
    assert bad.status_code == 400 and bad.json()["success"] is False
    # And generates too; the generation key generates.
    prompt = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}
    for key in (USER_KEY, ADMIN_KEY):
        assert (await keyed.post("/generate", json=prompt, headers=_bearer(key))).status_code == 200
    assert (await keyed.post("/generate", json=prompt)).status_code == 401


async def test_healthz_is_exactly_ok_and_metrics_need_a_key(keyed: httpx.AsyncClient) -> None:
    health = await keyed.get("/healthz")
    assert (health.status_code, health.text) == (200, "ok")
    for path in ("/metrics", "/healthz/details"):
        assert (await keyed.get(path)).status_code == 401, path
        assert (await keyed.get(path, headers=_bearer(USER_KEY))).status_code == 200, path
    details = (await keyed.get("/healthz/details", headers=_bearer(USER_KEY))).json()
    assert details["status"] == "ok" and "weight_version" in details
    assert (await keyed.get("/health")).status_code == 200  # SGLang's probes stay open


def test_a_start_without_admin_keys_warns_what_is_off_and_how_to_turn_it_on(
    engine: BatchEngine, caplog: pytest.LogCaptureFixture, model_dir: Path
) -> None:
    with caplog.at_level(logging.WARNING, logger="services.inference.wiring"):
        build_app(InferenceSettings(model_path=model_dir), engine)
    (warning,) = [r.getMessage() for r in caplog.records if "admin routes are off" in r.getMessage()]
    assert "/update_weights_from_disk and /flush_cache answer 403" in warning
    assert "SPADE_INFERENCE_ADMIN_KEYS" in warning and "SPADE_LEARNER_INFERENCE__API_KEY" in warning
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="services.inference.wiring"):
        build_app(InferenceSettings(admin_keys=[{"tenant": "l", "key_sha256": hash_key("k")}]), engine)
    assert not [r for r in caplog.records if "admin routes are off" in r.getMessage()]
