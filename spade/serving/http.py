"""One HTTP (uvicorn + FastAPI) bootstrap for every service, and the pieces every REST API shares.

- :func:`http_server`: serve an ASGI app on a :class:`ServerAddress` inside the caller's event loop
  until the context exits, then shut down gracefully; HTTPS (and required client certificates) when
  the address has ``tls``. Signals are not uvicorn's business here: ``spade.serving.run`` turns
  SIGTERM/SIGINT into the stop event every ``spade serve`` waits on. uvicorn logs through the
  process's logging set-up (``spade.serving.logs``); its access log is off.
- :func:`install_error_handlers`: one error shape, ``{"error": {"code": ..., "message": ...}}``, for
  domain errors (their kind's status), malformed requests, unknown routes and internal failures
  (answered without details). Never echoes the caller's input. It also installs
  :class:`RequestContext`: every request gets an id (the caller's ``x-request-id`` when sane, else a
  new one) that is sent back in the ``x-request-id`` response header and is on every log line of the
  request (with the service and, once authenticated, the tenant); each error is logged once (a
  refusal at INFO with its status and code, an internal failure at ERROR with its traceback).
- :func:`bearer_auth`: the FastAPI dependency checking ``Authorization: Bearer <key>`` against the
  service's :class:`spade.auth.KeyRing` (401), and the key's role when the route needs one
  (:func:`spade.auth.authorize`, 403).
- :func:`ops_router`: ``GET /healthz`` (open: the bare word ``ok``, 200, or ``unavailable``, 503),
  ``GET /healthz/details`` and ``GET /metrics`` (Prometheus), behind the service's key, the same for
  every service.
- :class:`HttpMetrics`: request counts by route and status, and latency by route.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from spade.auth import KeyRing, Role, authorize
from spade.errors import ErrorKind, ServiceError
from spade.serving.errors import HTTP_STATUS, ErrorKinds, classify
from spade.serving.logs import REQUEST_ID_HEADER, accept_request_id, annotate, log_context, tenant_name
from spade.serving.settings import ServerAddress

P = TypeVar("P")

Health = Callable[[], Awaitable[tuple[bool, dict[str, Any]]]]
"""Answers ``(healthy, body)``: ``/healthz`` sends ``body`` with 200 when healthy, else 503."""


# -- errors -------------------------------------------------------------------------------------------


def error_response(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """The one REST error body: ``{"error": {"code": code, "message": message}}``."""
    return JSONResponse(status_code=status, content={"error": {"code": code, "message": message}}, headers=headers)


_HTTP_CODES = {
    400: "invalid_request",
    401: "unauthenticated",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
}


class RequestContext:
    """ASGI middleware: a request id and a log context per request, and the last word on failures.

    - The id is the caller's ``x-request-id`` header when sane (``spade.serving.logs.accept_request_id``),
      else a new one; the response carries it in ``x-request-id`` and ``request.state.request_id`` holds it.
    - Every line logged while the request runs carries it (and the method, the path and, once
      :func:`bearer_auth` has run, the tenant).
    - An exception nothing else handled is logged once, with its traceback, and answered 500 in the
      one error shape (naming the request id, never the exception); the server does not log it again.

    Args:
        app: The wrapped app.
        service: The service's name in the message of an internal error.
    """

    def __init__(self, app: ASGIApp, *, service: str) -> None:
        self.app = app
        self.service = service
        self.log = logging.getLogger(f"spade.{service}.http")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        incoming = dict(scope.get("headers") or ()).get(REQUEST_ID_HEADER.encode())
        request_id = accept_request_id(incoming)
        scope.setdefault("state", {})["request_id"] = request_id
        started = False

        async def sending(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != REQUEST_ID_HEADER.encode()]
                headers.append((REQUEST_ID_HEADER.encode(), request_id.encode()))
                message = {**message, "headers": headers}
            await send(message)

        with log_context(request_id=request_id, method=scope.get("method"), path=scope.get("path")):
            try:
                await self.app(scope, receive, sending)
            except Exception as exc:
                self.log.error("request failed", exc_info=exc, extra={"status": 500, "code": "internal"})
                if started:  # a streamed response broke off: the client sees the connection end
                    return
                response = error_response(
                    500,
                    "internal",
                    f"internal error in the {self.service} service (request id {request_id}); it has been logged",
                )
                await response(scope, receive, sending)


def install_error_handlers(
    app: FastAPI, *, service: str, errors: ErrorKinds | None = None, invalid_status: int = 422
) -> None:
    """Answer every failure of ``app`` in the one error shape, mapping domain errors by kind.

    Also installs :class:`RequestContext` (request ids, the log context, internal failures), so call
    it once, before the app starts.

    Args:
        app: The FastAPI app.
        service: The service's name in logs and in the message of internal errors.
        errors: Extra exception types that are domain errors (with their kind and code), for libraries
            whose errors are not ``ServiceError`` subclasses.
        invalid_status: Status of an invalid request: 422, or 400 where an API imitates one that
            answers 400 (the inference server follows SGLang).
    """
    log = logging.getLogger(f"spade.{service}.http")
    app.add_middleware(RequestContext, service=service)

    def refused(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
        log.info("refused %d %s: %s", status, code, message, extra={"status": status, "code": code})
        return error_response(status, code, message, headers)

    async def domain(_: Request, exc: Exception) -> JSONResponse:
        found = classify(exc, errors)
        if found is None:  # registered for a base class whose subclass is not a domain error
            return await internal(_, exc)
        kind, code = found
        status = invalid_status if kind is ErrorKind.INVALID else HTTP_STATUS[kind]
        headers = {"WWW-Authenticate": "Bearer"} if kind is ErrorKind.UNAUTHENTICATED else None
        retry_after = getattr(exc, "retry_after_s", None)  # a quota's refusal says when to retry
        if isinstance(retry_after, int | float):
            headers = {"Retry-After": str(max(1, math.ceil(retry_after)))}
        return refused(status, code, str(exc), headers)

    async def bad_request(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        problems = []
        for err in exc.errors()[:10]:
            where = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
            problems.append(f"{where}: {err.get('msg', 'invalid')}")
        return refused(invalid_status, "invalid_request", "; ".join(problems) or "invalid request body")

    async def http_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code == 400:
            # FastAPI's own body-parsing failure (e.g. non-UTF-8 bytes): the same shape as any bad input.
            return refused(invalid_status, "invalid_request", "request body is not valid UTF-8 JSON")
        code = _HTTP_CODES.get(exc.status_code, "http_error")
        if exc.status_code >= 500:
            log.error("failed %d %s: %s", exc.status_code, code, exc.detail, extra={"status": exc.status_code})
            return error_response(exc.status_code, code, str(exc.detail), dict(exc.headers or {}) or None)
        return refused(exc.status_code, code, str(exc.detail), dict(exc.headers or {}) or None)

    async def internal(request: Request, exc: Exception) -> JSONResponse:
        # Reached only when RequestContext is not in the stack (it answers unhandled errors itself).
        log.error("request failed", exc_info=exc, extra={"status": 500, "code": "internal"})
        request_id = getattr(request.state, "request_id", None) or "unknown"
        return error_response(
            500, "internal", f"internal error in the {service} service (request id {request_id}); it has been logged"
        )

    declare_error_shape(app, invalid_status=invalid_status)
    app.add_exception_handler(ServiceError, domain)
    for cls in errors or {}:
        if issubclass(cls, Exception):
            app.add_exception_handler(cls, domain)
    app.add_exception_handler(RequestValidationError, bad_request)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, internal)


ERROR_SCHEMA: dict[str, Any] = {
    "title": "Error",
    "type": "object",
    "description": "The one error body of every SPADE REST API.",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["code", "message"],
            "properties": {
                "code": {"type": "string", "description": "Stable machine-readable identifier."},
                "message": {"type": "string", "description": "What went wrong and how to fix it, for a person."},
            },
        }
    },
}
"""OpenAPI schema of :func:`error_response`'s body."""


def declare_error_shape(app: FastAPI, *, invalid_status: int = 422) -> None:
    """Make ``app``'s OpenAPI schema say what an invalid request really gets: the one error shape.

    FastAPI declares every validation failure as 422 with its own ``HTTPValidationError`` body; the
    handlers of :func:`install_error_handlers` answer ``invalid_status`` with :data:`ERROR_SCHEMA`.
    """
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        if components.pop("HTTPValidationError", None) is not None:
            components.pop("ValidationError", None)
            components["Error"] = ERROR_SCHEMA
            for operation in (op for item in schema.get("paths", {}).values() for op in item.values()):
                responses = operation.get("responses", {})
                if "422" in responses:
                    declared = responses.pop("422")
                    declared["description"] = "Invalid request"
                    declared["content"] = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
                    responses[str(invalid_status)] = declared
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


# -- authentication -----------------------------------------------------------------------------------

_BEARER = HTTPBearer(auto_error=False, description="Authorization: Bearer <API key>")


def bearer_auth(
    keyring: KeyRing[P], *, cookie: str | None = None, role: Role | None = None, action: str = "this call"
) -> Callable[..., P]:
    """A FastAPI dependency answering the caller's principal, or 401/403 in the one error shape.

    Args:
        keyring: The service's keys.
        cookie: A cookie that may carry the key instead of the header (a web page's login).
        role: The role the route needs (``spade.auth.authorize``: a known key below it gets 403);
            ``None``: any known key.
        action: What the route does, for the 403's message ("replacing the run spec").
    """

    def authenticated(request: Request, _: HTTPAuthorizationCredentials | None = Depends(_BEARER)) -> P:
        header = request.headers.get("authorization")
        if not header and cookie and request.cookies.get(cookie):
            header = f"Bearer {request.cookies[cookie]}"
        principal = keyring.authenticate(header)
        tenant = tenant_name(principal)
        annotate(tenant=tenant)  # the request's log lines name the tenant from here on
        request.state.tenant = tenant  # and HttpMetrics its latency
        if role is not None:
            authorize(principal, role, action)
        return principal

    return authenticated


# -- health and metrics -------------------------------------------------------------------------------


HEALTH_WORDS = {True: "ok", False: "unavailable"}
"""The whole body of an unauthenticated ``GET /healthz``: it tells whether, never what or where."""


def ops_router(*, health: Health, registry: CollectorRegistry, guard: Callable[..., Any] | None) -> APIRouter:
    """The operations routes every service serves the same way.

    - ``GET /healthz``: open (probes send no key): 200 ``ok`` or 503 ``unavailable``, as plain text,
      and nothing else (no paths, pids, versions or tenants for whoever reaches the port);
    - ``GET /healthz/details``: ``health``'s body (JSON, 200 or 503), behind ``guard``;
    - ``GET /metrics``: Prometheus text, behind ``guard`` (the series name tenants and routes).

    Args:
        health: Answers ``(healthy, details)``.
        registry: What ``/metrics`` exposes.
        guard: The dependency a caller must pass for the details and the metrics (the service's
            ``bearer_auth(keyring, role=Role.READ)``); ``None``: open, for a service without keys
            (dev mode, loopback), where everything else is open too.
    """
    router = APIRouter(tags=["ops"])
    guarded = [Depends(guard)] if guard is not None else []

    @router.get("/healthz", response_class=PlainTextResponse, responses={503: {"content": {"text/plain": {}}}})
    async def healthz() -> PlainTextResponse:
        """``ok`` (200) or ``unavailable`` (503); the details are at ``/healthz/details``, with a key."""
        healthy, _ = await health()
        return PlainTextResponse(HEALTH_WORDS[healthy], status_code=200 if healthy else 503)

    @router.get("/healthz/details", dependencies=guarded)
    async def healthz_details() -> JSONResponse:
        healthy, body = await health()
        return JSONResponse(status_code=200 if healthy else 503, content=body)

    @router.get("/metrics", dependencies=guarded)
    async def metrics() -> Response:
        body = await asyncio.to_thread(generate_latest, registry)
        return Response(content=body, media_type=CONTENT_TYPE_LATEST)

    return router


class HttpMetrics:
    """ASGI middleware: ``spade_<service>_http_requests{route,code}``, ``spade_<service>_http_seconds{route,tenant}``.

    ``tenant`` is the caller's tenant once :func:`bearer_auth` has authenticated it (empty for open
    routes and servers without keys): a server shared by several roles (the inference server serves
    the designer and the rollout) tells how much of its time each one took.

    Args:
        app: The wrapped app.
        service: The service's name in the metric names.
        registry: Where the metrics go.
    """

    def __init__(self, app: ASGIApp, *, service: str, registry: CollectorRegistry) -> None:
        self.app = app
        self.requests = Counter(
            f"spade_{service}_http_requests", "HTTP requests by route and status.", ["route", "code"], registry=registry
        )
        self.latency = Histogram(
            f"spade_{service}_http_seconds", "HTTP latency by route and tenant.", ["route", "tenant"], registry=registry
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            tenant = (scope.get("state") or {}).get("tenant") or ""
            self.requests.labels(route, str(status)).inc()
            self.latency.labels(route, str(tenant)).observe(time.perf_counter() - start)


# -- the server ---------------------------------------------------------------------------------------


class _Server(uvicorn.Server):
    """uvicorn without its own signal handlers: ``spade.serving.run`` owns SIGTERM/SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def serve_in_task(self, sock: socket.socket) -> None:
        """``serve`` on a bound socket; uvicorn's ``sys.exit`` on a failed start becomes an error."""
        try:
            await self.serve(sockets=[sock])
        except SystemExit as exc:  # a SystemExit escaping a task would stop the caller's event loop
            raise RuntimeError(f"uvicorn stopped with exit status {exc.code} (see its log)") from None


def bind_socket(bind: ServerAddress) -> socket.socket:
    """A TCP socket bound to ``bind`` (not yet listening).

    Raises:
        OSError: The address is taken or invalid.
    """
    family = socket.AF_INET6 if ":" in bind.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((bind.host, bind.port))
    except OSError:
        sock.close()
        raise
    return sock


@dataclass(frozen=True)
class RunningHttp:
    """A started HTTP server: the bound port (resolved when 0 was asked) and the server."""

    port: int
    server: uvicorn.Server


@contextlib.asynccontextmanager
async def http_server(
    app: ASGIApp,
    bind: ServerAddress,
    *,
    service: str,
    log_level: str = "warning",
    lifespan: Literal["auto", "on", "off"] = "auto",
) -> AsyncIterator[RunningHttp]:
    """Serve ``app`` on ``bind`` in this event loop until the context exits, then shut down gracefully.

    Raises:
        OSError: The address could not be bound (the port is taken, say).
        RuntimeError: The server did not start (the app's lifespan start-up failed, say).
    """
    try:
        sock = bind_socket(bind)
    except OSError as exc:
        raise OSError(
            f"the {service} HTTP server could not bind {bind.address} ({exc.strerror}); is the port free?"
        ) from exc
    port = int(sock.getsockname()[1])
    tls = bind.tls.uvicorn_options() if bind.tls is not None else {}
    config = uvicorn.Config(
        app,
        host=bind.host,
        port=port,
        log_level=log_level,
        lifespan=lifespan,
        log_config=None,  # uvicorn logs through the process's set-up (spade.serving.logs), not its own
        access_log=False,  # errors are logged once by the app; successes are counted in /metrics
        **tls,
    )
    server = _Server(config)
    task = asyncio.create_task(server.serve_in_task(sock))
    try:
        while not server.started:
            if task.done():
                await task  # raises the start-up failure
                raise RuntimeError(f"the {service} HTTP server stopped while starting on {bind.address}")
            await asyncio.sleep(0.01)
        scheme = "https" if bind.tls is not None else "http"
        log = logging.getLogger(f"spade.{service}.http")
        log.info("%s HTTP listening on %s://%s:%d", service, scheme, bind.host, port)
        yield RunningHttp(port=port, server=server)
    finally:
        server.should_exit = True
        await task
        sock.close()
