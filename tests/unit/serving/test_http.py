"""The shared HTTP pieces: one error shape, bearer auth, /healthz + /metrics, the uvicorn bootstrap."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi import Depends, FastAPI
from prometheus_client import CollectorRegistry
from pydantic import BaseModel

from spade.auth import KeyRing, Principal, Role, hash_key
from spade.errors import ErrorKind, ServiceError
from spade.serving.http import HttpMetrics, bearer_auth, http_server, install_error_handlers, ops_router
from spade.serving.settings import ServerAddress


class Gone(ServiceError):
    kind = ErrorKind.NOT_FOUND
    code = "env_not_found"


class LibraryError(Exception):
    """A library's error the app declares a domain error."""


class Body(BaseModel):
    n: int


def make_app(healthy: list[bool]) -> tuple[FastAPI, CollectorRegistry]:
    registry = CollectorRegistry()
    ring = KeyRing({hash_key("k"): Principal("alice", Role.WRITE), hash_key("r"): Principal("watch", Role.READ)})
    app = FastAPI()
    install_error_handlers(app, service="demo", errors={LibraryError: (ErrorKind.UNAVAILABLE, "busy")})

    async def health() -> tuple[bool, dict[str, Any]]:
        return healthy[0], {"status": "ok" if healthy[0] else "unavailable", "pid": 4242, "cgroup": "/sys/fs/x"}

    app.include_router(ops_router(health=health, registry=registry, guard=bearer_auth(ring, role=Role.READ)))

    @app.post("/v1/admin")
    async def admin(who: Principal = Depends(bearer_auth(ring, role=Role.ADMIN, action="changing demo"))) -> str:
        return who.tenant

    app.add_middleware(HttpMetrics, service="demo", registry=registry)

    @app.post("/v1/echo")
    async def echo(body: Body, who: Principal = Depends(bearer_auth(ring, cookie="demo_token"))) -> dict[str, Any]:
        if body.n == 404:
            raise Gone("no environment 'x': list ids with GET /v1/environments")
        if body.n == 503:
            raise LibraryError("the engine is busy")
        if body.n == 500:
            raise RuntimeError("secret internal detail")
        return {"who": getattr(who, "tenant", who), "n": body.n}

    return app, registry


@pytest.fixture
def healthy() -> list[bool]:
    return [True]


@pytest.fixture
async def http(healthy: list[bool]) -> AsyncIterator[httpx.AsyncClient]:
    app, _ = make_app(healthy)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://demo") as client:
        yield client


def error(response: httpx.Response) -> tuple[int, str, str]:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message"}, body
    return response.status_code, body["error"]["code"], body["error"]["message"]


async def test_every_failure_has_the_one_error_shape(http: httpx.AsyncClient) -> None:
    auth = {"Authorization": "Bearer k"}
    assert (await http.post("/v1/echo", json={"n": 1}, headers=auth)).json() == {"who": "alice", "n": 1}
    assert error(await http.post("/v1/echo", json={"n": 404}, headers=auth))[:2] == (404, "env_not_found")
    assert error(await http.post("/v1/echo", json={"n": 503}, headers=auth)) == (503, "busy", "the engine is busy")
    status, code, message = error(await http.post("/v1/echo", json={"n": 500}, headers=auth))
    assert (status, code) == (500, "internal") and "secret" not in message
    status, code, message = error(await http.post("/v1/echo", json={"n": "my code"}, headers=auth))
    assert (status, code) == (422, "invalid_request") and "n:" in message and "my code" not in message
    assert error(await http.get("/nope"))[:2] == (404, "not_found")
    assert error(await http.get("/v1/echo"))[:2] == (405, "method_not_allowed")


async def test_bearer_auth_refuses_missing_wrong_and_malformed_keys(http: httpx.AsyncClient) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic k"}):
        response = await http.post("/v1/echo", json={"n": 1}, headers=headers)
        assert error(response)[:2] == (401, "unauthenticated")
        assert response.headers["www-authenticate"] == "Bearer"
    http.cookies.set("demo_token", "k")
    assert (await http.post("/v1/echo", json={"n": 2})).json()["who"] == "alice"


async def test_a_known_key_without_the_role_gets_403_an_unknown_one_401(http: httpx.AsyncClient) -> None:
    status, code, message = error(await http.post("/v1/admin", headers={"Authorization": "Bearer k"}))
    assert (status, code) == (403, "forbidden")
    assert "'alice' has the write role; changing demo needs admin" in message
    assert error(await http.post("/v1/admin", headers={"Authorization": "Bearer nope"}))[:2] == (401, "unauthenticated")
    assert error(await http.post("/v1/admin"))[:2] == (401, "unauthenticated")


async def test_healthz_says_only_ok_and_details_and_metrics_need_a_key(
    http: httpx.AsyncClient, healthy: list[bool]
) -> None:
    response = await http.get("/healthz")
    assert (response.status_code, response.text) == (200, "ok")
    assert response.headers["content-type"].startswith("text/plain")
    for path in ("/healthz/details", "/metrics"):
        assert error(await http.get(path))[:2] == (401, "unauthenticated"), path
    details = await http.get("/healthz/details", headers={"Authorization": "Bearer r"})  # read is enough
    assert details.json()["pid"] == 4242
    healthy[0] = False
    response = await http.get("/healthz")
    assert (response.status_code, response.text) == (503, "unavailable")
    assert (await http.get("/healthz/details", headers={"Authorization": "Bearer r"})).status_code == 503
    await http.post("/v1/echo", json={"n": 1})
    await http.post("/v1/echo", json={"n": 1}, headers={"Authorization": "Bearer k"})
    metrics = (await http.get("/metrics", headers={"Authorization": "Bearer r"})).text
    assert 'spade_demo_http_requests_total{code="401",route="/v1/echo"} 1.0' in metrics
    # Latency by tenant: the authenticated call is alice's, the refused one nobody's.
    assert 'spade_demo_http_seconds_count{route="/v1/echo",tenant="alice"} 1.0' in metrics
    assert 'spade_demo_http_seconds_count{route="/v1/echo",tenant=""} 1.0' in metrics


async def test_the_server_binds_port_zero_serves_and_refuses_a_taken_port(healthy: list[bool]) -> None:
    app, _ = make_app(healthy)
    async with http_server(app, ServerAddress(port=0), service="demo") as running:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{running.port}") as client:
            assert (await client.get("/healthz")).status_code == 200
        with pytest.raises(OSError, match="is the port free"):
            async with http_server(app, ServerAddress(port=running.port), service="demo"):
                pass
    with socket.socket() as probe:  # the port was released at exit
        probe.bind(("127.0.0.1", running.port))
