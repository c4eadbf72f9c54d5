"""The one logging set-up: JSON lines with service/tenant/env/request id, request ids both ways, errors once."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import grpc
import httpx
import pytest
from fastapi import Depends, FastAPI

from spade.auth import KeyRing, hash_key
from spade.errors import ErrorKind, ServiceError
from spade.serving import logs
from spade.serving.grpc import GrpcService, grpc_server
from spade.serving.http import bearer_auth, http_server, install_error_handlers
from spade.serving.settings import ServerAddress
from spade.v1 import sandbox_pb2, sandbox_pb2_grpc

Lines = Callable[[], list[dict[str, Any]]]


@pytest.fixture
def lines() -> Iterator[Lines]:
    """Route this process's logging through ``configure`` into a buffer; returns the parsed JSON lines."""
    root = logging.getLogger()
    level = root.level
    buffer = io.StringIO()
    logs.configure("demo", stream=buffer)
    yield lambda: [json.loads(line) for line in buffer.getvalue().splitlines() if line.strip()]
    logs.reset()
    root.setLevel(level)
    for name in logs.NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.NOTSET)


def test_a_line_is_one_json_object_with_the_context_and_the_fields(lines: Lines) -> None:
    log = logging.getLogger("spade.demo")
    with logs.log_context(request_id="r-1", tenant="alice"):
        logs.annotate(env_id="e-9")
        logs.log_event(log, "play", version=3, arm="hint", reward=0.5, name="clash")
        log.info("plain %s", "message", extra={"seed": 7})
    log.warning("outside")
    play, plain, outside = lines()
    assert play["service"] == "demo" and play["logger"] == "spade.demo" and play["level"] == "info"
    assert (play["event"], play["request_id"], play["tenant"], play["env_id"]) == ("play", "r-1", "alice", "e-9")
    assert (play["version"], play["arm"], play["reward"], play["name_"]) == (3, "hint", 0.5, "clash")
    assert plain["message"] == "plain message" and plain["seed"] == 7 and plain["env_id"] == "e-9"
    assert "request_id" not in outside and outside["level"] == "warning"


def test_library_info_noise_is_off_and_their_warnings_stay(lines: Lines) -> None:
    logging.getLogger("alembic.runtime.migration").info("Context impl PostgresqlImpl.")
    logging.getLogger("httpx").info("HTTP Request: GET http://x 200")
    logging.getLogger("uvicorn.error").info("Started server process")
    logging.getLogger("alembic").warning("a real warning")
    assert [line["message"] for line in lines()] == ["a real warning"]


def test_a_traceback_stays_inside_its_line(lines: Lines) -> None:
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logging.getLogger("spade.demo").exception("failed")
    [line] = lines()
    assert "RuntimeError: boom" in line["exc"]


def test_text_format_and_bad_environment_values() -> None:
    buffer = io.StringIO()
    logs.configure("demo", json=False, stream=buffer)
    try:
        with logs.log_context(request_id="r-2"):
            logging.getLogger("spade.demo").info("hello")
        assert " INFO demo spade.demo: hello [request_id=r-2]" in buffer.getvalue()
        with pytest.raises(ValueError, match="SPADE_LOG_FORMAT"):
            logs.configure_from_env("demo", {"SPADE_LOG_FORMAT": "xml"})
        with pytest.raises(ValueError, match="SPADE_LOG_LEVEL"):
            logs.configure_from_env("demo", {"SPADE_LOG_LEVEL": "LOUD"})
    finally:
        logs.reset()


def test_request_ids_are_accepted_only_when_sane() -> None:
    assert logs.accept_request_id("trace-1.2:3") == "trace-1.2:3"
    for bad in (None, "", "x" * 129, "has space", "<script>", "new\nline"):
        fresh = logs.accept_request_id(bad)
        assert fresh != bad and len(fresh) == 32


# -- HTTP --------------------------------------------------------------------------------------------


class Missing(ServiceError):
    kind = ErrorKind.NOT_FOUND
    code = "env_not_found"


def make_app() -> FastAPI:
    ring = KeyRing({hash_key("k"): "alice"})
    app = FastAPI()
    install_error_handlers(app, service="demo")

    @app.get("/v1/envs/{env_id}")
    async def env(env_id: str, who: str = Depends(bearer_auth(ring))) -> dict[str, str]:
        logs.annotate(env_id=env_id)
        if env_id == "gone":
            raise Missing(f"no environment {env_id!r}")
        if env_id == "bug":
            raise RuntimeError("secret internal detail")
        return {"who": who}

    return app


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=make_app(), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://demo") as client:
        yield client


async def test_http_sends_the_request_id_back_and_honours_the_callers(http: httpx.AsyncClient) -> None:
    auth = {"Authorization": "Bearer k"}
    mine = await http.get("/v1/envs/e1", headers={**auth, "x-request-id": "caller-42"})
    assert mine.status_code == 200 and mine.headers["x-request-id"] == "caller-42"
    fresh = await http.get("/v1/envs/e1", headers=auth)
    assert len(fresh.headers["x-request-id"]) == 32
    for response in (await http.get("/v1/envs/e1"), await http.get("/nowhere", headers={"x-request-id": "bad id"})):
        assert response.status_code in (401, 404) and len(response.headers["x-request-id"]) == 32


async def test_http_errors_are_logged_once_with_request_id_tenant_and_env(
    http: httpx.AsyncClient, lines: Lines
) -> None:
    auth = {"Authorization": "Bearer k"}
    refused = await http.get("/v1/envs/gone", headers={**auth, "x-request-id": "req-404"})
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "env_not_found"
    crashed = await http.get("/v1/envs/bug", headers={**auth, "x-request-id": "req-500"})
    assert crashed.status_code == 500 and crashed.headers["x-request-id"] == "req-500"
    body = crashed.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message"}
    assert "secret" not in crashed.text and "req-500" in body["error"]["message"]
    unauthenticated = await http.get("/v1/envs/e1", headers={"x-request-id": "req-401"})
    assert unauthenticated.status_code == 401

    by_id: dict[str, list[dict[str, Any]]] = {}
    for line in lines():
        by_id.setdefault(line.get("request_id", "-"), []).append(line)
    [gone] = by_id["req-404"]
    assert (gone["level"], gone["status"], gone["code"], gone["tenant"], gone["env_id"]) == (
        "info",
        404,
        "env_not_found",
        "alice",
        "gone",
    )
    [bug] = by_id["req-500"]
    assert bug["level"] == "error" and "RuntimeError: secret internal detail" in bug["exc"]
    assert (bug["tenant"], bug["env_id"], bug["path"]) == ("alice", "bug", "/v1/envs/bug")
    [anonymous] = by_id["req-401"]
    assert anonymous["status"] == 401 and "tenant" not in anonymous


async def test_a_real_server_logs_an_internal_failure_once(lines: Lines) -> None:
    async with (
        http_server(make_app(), ServerAddress(port=0), service="demo") as running,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{running.port}") as client,
    ):
        response = await client.get("/v1/envs/bug", headers={"Authorization": "Bearer k"})
    assert response.status_code == 500
    tracebacks = [line for line in lines() if "RuntimeError" in line.get("exc", "")]
    assert len(tracebacks) == 1, tracebacks  # not again by uvicorn ("Exception in ASGI application")
    assert tracebacks[0]["request_id"] == response.headers["x-request-id"]


# -- gRPC --------------------------------------------------------------------------------------------


class Demo(sandbox_pb2_grpc.SandboxServicer):
    async def Validate(  # noqa: N802
        self, request: sandbox_pb2.ValidateRequest, context: object
    ) -> sandbox_pb2.ValidationReport:
        logs.annotate(env_id=request.code)
        if request.code == "crash":
            raise KeyError("secret internal detail")
        if request.code == "missing":
            raise Missing("no environment 'missing'")
        return sandbox_pb2.ValidationReport(env_class=logs.current_request_id() or "")


def trailer(metadata: Any) -> dict[str, Any]:
    return {str(k): v for k, v in (metadata or ())}


async def test_grpc_sends_the_request_id_in_trailing_metadata_and_logs_errors_once(lines: Lines) -> None:
    ring = KeyRing({hash_key("k"): "alice"})
    service = GrpcService(
        sandbox_pb2.DESCRIPTOR.services_by_name["Sandbox"].full_name,
        lambda server: sandbox_pb2_grpc.add_SandboxServicer_to_server(Demo(), server),
    )
    auth = (("authorization", "Bearer k"),)
    async with (
        grpc_server([service], ServerAddress(port=0), service="demo", authenticate=ring.authenticate) as running,
        grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel,
    ):
        stub = sandbox_pb2_grpc.SandboxStub(channel)
        call = stub.Validate(sandbox_pb2.ValidateRequest(code="ok"), metadata=(*auth, ("x-request-id", "g-1")))
        assert (await call).env_class == "g-1"  # the servicer's log context has it
        assert trailer(await call.trailing_metadata())["x-request-id"] == "g-1"
        fresh = stub.Validate(sandbox_pb2.ValidateRequest(code="ok"), metadata=auth)
        assert len(trailer(await fresh.trailing_metadata())["x-request-id"]) == 32
        failures: dict[str, grpc.aio.AioRpcError] = {}
        for code, metadata in (("missing", auth), ("crash", auth), ("ok", ())):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Validate(
                    sandbox_pb2.ValidateRequest(code=code), metadata=(*metadata, ("x-request-id", f"g-{code}"))
                )
            failures[code] = info.value
    for code, error in failures.items():
        assert trailer(error.trailing_metadata())["x-request-id"] == f"g-{code}"
    assert failures["crash"].code() == grpc.StatusCode.INTERNAL
    assert "g-crash" in (failures["crash"].details() or "") and "secret" not in (failures["crash"].details() or "")
    logged = [line for line in lines() if line.get("request_id", "").startswith("g-") and line["level"] != "debug"]
    assert sorted(line["request_id"] for line in logged) == ["g-crash", "g-missing", "g-ok"]
    by_id = {line["request_id"]: line for line in logged}
    assert (by_id["g-missing"]["status"], by_id["g-missing"]["tenant"], by_id["g-missing"]["env_id"]) == (
        "NOT_FOUND",
        "alice",
        "missing",
    )
    assert by_id["g-crash"]["level"] == "error" and "KeyError" in by_id["g-crash"]["exc"]
    assert by_id["g-ok"]["status"] == "UNAUTHENTICATED" and "tenant" not in by_id["g-ok"]
