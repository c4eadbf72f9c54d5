"""One gRPC server bootstrap for every service: bind, reflection, health, and the interceptors.

:func:`grpc_server` starts a ``grpc.aio`` server with the given servicers and, around every call of
theirs, one interceptor that:

- **authenticates** the caller from the ``authorization`` metadata (when the service has keys),
  **authorizes** the call against the role its service declares for the method
  (:attr:`GrpcService.roles`, decided by :func:`spade.auth.authorize`: ``PERMISSION_DENIED``) and
  makes the principal available to the servicer through :func:`caller`; a client-streaming call is
  authenticated once its first message is in (an abort before the client has sent anything reaches
  grpc.aio clients as INTERNAL instead of the real status);
- **refuses a malformed request message** (bytes that are not the method's protobuf message) with
  INVALID_ARGUMENT (``spade.errors.InvalidInput``), where grpc.aio itself would answer UNKNOWN;
- **maps errors to statuses** in one place: a :class:`spade.errors.ServiceError` aborts with its
  kind's status and its message (its stable code in the ``error-code`` trailer), anything else is
  logged with its traceback and answered INTERNAL without details;
- **tags each call with a request id**: the caller's ``x-request-id`` metadata when sane, else a new
  one; it is sent back in the trailing metadata (success or failure) and is on every log line of the
  call, with the service, the tenant and whatever the servicer adds (``spade.serving.logs.annotate``);
- **logs** each failure once (a refusal at INFO with its status, an internal error at ERROR with
  its traceback) and each call at DEBUG (method, status, duration);
- **counts** calls in Prometheus (``spade_<service>_grpc_requests{method,code}`` and the latency
  histogram ``spade_<service>_grpc_seconds{method}``) in the service's registry.

The standard health service (``grpc.health.v1.Health``) answers SERVING for the server and each
service while it runs and NOT_SERVING once shutdown begins; server reflection lists every service.
With ``bind.tls`` the server listens with TLS only (mutual TLS when a client CA is configured).
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio  # type: ignore[attr-defined]  # the stubs lack the aio servicer
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, Counter, Histogram

from spade.auth import Role, authorize
from spade.errors import InvalidInput
from spade.serving.errors import ERROR_CODE_TRAILER, GRPC_STATUS, ErrorKinds, classify
from spade.serving.logs import REQUEST_ID_HEADER, accept_request_id, annotate, enter_context, tenant_name
from spade.serving.settings import ServerAddress

_CALLER: contextvars.ContextVar[Any] = contextvars.ContextVar("spade_grpc_caller", default=None)

_OPEN_METHODS = ("/grpc.health.v1.Health/", "/grpc.reflection.")
"""Methods served without authentication, logging or metrics (probes and tooling)."""

Authenticate = Callable[[str | None], Any]
"""Maps the ``authorization`` metadata value to a principal, raising ``spade.auth.Unauthenticated``."""


def caller() -> Any:
    """The principal the current call was authenticated as (``None`` when the server has no auth)."""
    return _CALLER.get()


@dataclass(frozen=True)
class GrpcService:
    """One servicer to serve.

    Attributes:
        name: The service's full proto name (``spade.v1.Sandbox``), for reflection and health.
        add: Adds the servicer to a server (``lambda s: add_SandboxServicer_to_server(servicer, s)``).
        roles: The role each method needs, by method name (``{"SetRunSpec": Role.ADMIN}``), checked
            on an authenticated server once the caller is known; a method missing from a non-empty
            table needs ``admin``. Empty: any authenticated caller may call every method.
    """

    name: str
    add: Callable[[grpc.aio.Server], None]
    roles: Mapping[str, Role] = field(default_factory=dict)


@dataclass(frozen=True)
class RunningGrpc:
    """A started gRPC server: the bound port (resolved when 0 was asked) and the server."""

    port: int
    server: grpc.aio.Server


class _Instruments:
    def __init__(self, service: str, registry: CollectorRegistry | None) -> None:
        self.requests = Counter(
            f"spade_{service}_grpc_requests",
            "gRPC calls by method and status.",
            ["method", "code"],
            registry=registry,
        )
        self.latency = Histogram(
            f"spade_{service}_grpc_seconds",
            "gRPC call latency by method (streams: the whole stream).",
            ["method"],
            registry=registry,
        )


class ServiceInterceptor(grpc.aio.ServerInterceptor):
    """Authentication, error mapping, logging and metrics around every call (see the module docstring).

    Args:
        service: The service's name in logs, errors and metric names (``sandbox``).
        authenticate: Maps the ``authorization`` metadata to a principal; ``None``: no authentication.
        registry: Where the call metrics go (the registry the service's ``/metrics`` exposes).
        errors: Extra exception types that are domain errors (with their kind and code).
        roles: The role each method needs, by service full name then method name (``GrpcService.roles``).
    """

    def __init__(
        self,
        service: str,
        *,
        authenticate: Authenticate | None = None,
        registry: CollectorRegistry | None = None,
        errors: ErrorKinds | None = None,
        roles: Mapping[str, Mapping[str, Role]] | None = None,
    ) -> None:
        self._service = service
        self._authenticate = authenticate
        self._roles = {name: table for name, table in (roles or {}).items() if table}
        self._errors = errors
        self._metrics = _Instruments(service, registry) if registry is not None else None
        self._log = logging.getLogger(f"spade.{service}.grpc")

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = str(handler_call_details.method)
        if handler is None or method.startswith(_OPEN_METHODS):
            return handler
        wrap: dict[str, Any] = {
            "request_deserializer": _tolerant(handler.request_deserializer),
            "response_serializer": handler.response_serializer,
        }
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(self._unary(method, handler.unary_unary), **wrap)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(self._streaming(method, handler.unary_stream, False), **wrap)
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(self._unary(method, handler.stream_unary, True), **wrap)
        assert handler.stream_stream is not None
        return grpc.stream_stream_rpc_method_handler(self._streaming(method, handler.stream_stream, True), **wrap)

    # ---- the pieces ---------------------------------------------------------------------------------

    def _principal(self, method: str, context: grpc.aio.ServicerContext) -> Any:
        if self._authenticate is None:
            return None
        value = dict(context.invocation_metadata() or ()).get("authorization")
        principal = self._authenticate(value if isinstance(value, str) else None)
        annotate(tenant=tenant_name(principal))
        service, _, name = method.lstrip("/").partition("/")
        table = self._roles.get(service)
        if table is not None:
            authorize(principal, table.get(name, Role.ADMIN), f"{service}/{name}")
        return principal

    async def _fail(self, method: str, exc: BaseException, context: grpc.aio.ServicerContext, request_id: str) -> None:
        found = classify(exc, self._errors)
        trailer: tuple[tuple[str, str], ...] = ((REQUEST_ID_HEADER, request_id),)
        if found is None:
            self._log.error(
                "%s failed", method, exc_info=exc, extra={"method": method, "status": "INTERNAL", "code": "internal"}
            )
            await context.abort(
                grpc.StatusCode.INTERNAL,
                f"internal error in the {self._service} service; see its log (request id {request_id})",
                trailing_metadata=trailer,
            )
        else:
            kind, code = found
            status = GRPC_STATUS[kind]
            fields = {"method": method, "status": status.name, "code": code}
            trailer += ((ERROR_CODE_TRAILER, code),)
            self._log.info("%s refused (%s): %s", method, kind.value, exc, extra=fields)
            retry_after = getattr(exc, "retry_after_s", None)  # a quota's refusal says when to retry
            if isinstance(retry_after, int | float):
                trailer += (("retry-after", str(max(1, math.ceil(retry_after)))),)
            await context.abort(status, str(exc), trailing_metadata=trailer)

    def _observe(self, method: str, start: float, context: grpc.aio.ServicerContext, failed: bool) -> None:
        code = "OK"
        if failed:
            with contextlib.suppress(Exception):
                status = context.code()
                code = status.name if isinstance(status, grpc.StatusCode) else "UNKNOWN"
            code = "UNKNOWN" if code == "OK" else code
        elapsed = time.perf_counter() - start
        if self._metrics is not None:
            name = method.rsplit("/", 1)[-1]
            self._metrics.requests.labels(name, code).inc()
            self._metrics.latency.labels(name).observe(elapsed)
        self._log.debug("%s %s in %.1f ms", method, code, elapsed * 1000)

    async def _enter(self, method: str, request: Any, context: grpc.aio.ServicerContext, client_streams: bool) -> Any:
        """Authenticate the call (a client stream once its first message is in); the request to pass on.

        A request that did not parse is refused here (unary) or where the servicer reads it (stream),
        as ``InvalidInput``: INVALID_ARGUMENT, after authentication.
        """
        if client_streams:
            iterator = request.__aiter__()
            try:
                head = [await iterator.__anext__()]
            except StopAsyncIteration:
                head = []
            request = _chain(method, head, iterator)
        _CALLER.set(self._principal(method, context))
        if isinstance(request, _Malformed):
            raise request.refusal(method)
        return request

    # ---- wrappers -------------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _guard(self, method: str, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
        """Errors to statuses, then the call's log line and metrics, around one call."""
        start = time.perf_counter()
        failed = True
        metadata = dict(context.invocation_metadata() or ())
        request_id = accept_request_id(metadata.get(REQUEST_ID_HEADER))
        # Each call runs in a task of its own: the fields last as long as the call.
        enter_context(request_id=request_id, rpc=method.rsplit("/", 1)[-1])
        with contextlib.suppress(Exception):  # a closed call cannot take metadata; nothing to tell then
            context.set_trailing_metadata(((REQUEST_ID_HEADER, request_id),))
        try:
            yield
            failed = False
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await self._fail(method, exc, context, request_id)
            raise
        finally:
            self._observe(method, start, context, failed)

    def _unary(self, method: str, inner: Callable[..., Any], client_streams: bool = False) -> Callable[..., Any]:
        async def behavior(request: Any, context: grpc.aio.ServicerContext) -> Any:
            async with self._guard(method, context):
                result = inner(await self._enter(method, request, context, client_streams), context)
                if inspect.isawaitable(result):
                    result = await result
                return result

        return behavior

    def _streaming(self, method: str, inner: Callable[..., Any], client_streams: bool) -> Callable[..., Any]:
        async def behavior(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async with self._guard(method, context):
                responses = inner(await self._enter(method, request, context, client_streams), context)
                if inspect.isawaitable(responses):  # a handler that answers with context.write()
                    await responses
                else:
                    async for response in responses:
                        yield response

        return behavior


async def _chain(method: str, head: list[Any], rest: Any) -> AsyncIterator[Any]:
    """The stream's messages, the first already read; one that did not parse is refused where it is read."""
    for item in head:
        if isinstance(item, _Malformed):
            raise item.refusal(method)
        yield item
    async for item in rest:
        if isinstance(item, _Malformed):
            raise item.refusal(method)
        yield item


@dataclass(frozen=True)
class _Malformed:
    """A request message that did not parse (in place of the message: grpc.aio answers UNKNOWN to a
    deserializer that raises, so the interceptor's deserializer never does)."""

    problem: str

    def refusal(self, method: str) -> InvalidInput:
        return InvalidInput(
            f"the {method.rsplit('/', 1)[-1]} request is not a valid protobuf message of its type "
            f"({self.problem}): send the message the method's .proto declares"
        )


def _tolerant(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserialize is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as exc:  # DecodeError, or a string field that is not UTF-8
            return _Malformed(f"{type(exc).__name__}: {str(exc)[:120]}")

    return parse


@contextlib.asynccontextmanager
async def grpc_server(
    services: Sequence[GrpcService],
    bind: ServerAddress,
    *,
    service: str,
    authenticate: Authenticate | None = None,
    registry: CollectorRegistry | None = None,
    errors: ErrorKinds | None = None,
    max_receive_bytes: int = 4 * 2**20,
    max_send_bytes: int = 64 * 2**20,
    grace_s: float = 5.0,
) -> AsyncIterator[RunningGrpc]:
    """Serve ``services`` on ``bind`` until the context exits, then shut down gracefully.

    Args:
        services: The servicers.
        bind: Interface and port (port 0 picks a free one; see ``RunningGrpc.port``).
        service: The service's name in logs, errors and metric names.
        authenticate: Maps ``authorization`` metadata to a principal (see :func:`caller`); ``None``
            serves without authentication (and without the services' roles).
        registry: Prometheus registry for the call metrics (``None``: not counted).
        errors: Extra exception types that are domain errors (with their kind and code).
        max_receive_bytes: Largest request message accepted.
        max_send_bytes: Largest response message sent.
        grace_s: How long in-flight calls may finish at shutdown.

    Raises:
        OSError: The address could not be bound.
    """
    interceptor = ServiceInterceptor(
        service,
        authenticate=authenticate,
        registry=registry,
        errors=errors,
        roles={s.name: s.roles for s in services},
    )
    server = grpc.aio.server(
        interceptors=[interceptor],
        options=[
            ("grpc.max_receive_message_length", max_receive_bytes),
            ("grpc.max_send_message_length", max_send_bytes),
            # A taken port is an error, not a second server silently sharing it.
            ("grpc.so_reuseport", 0),
        ],
    )
    for item in services:
        item.add(server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
    reflection.enable_server_reflection([*(s.name for s in services), health_name, reflection.SERVICE_NAME], server)
    try:
        if bind.tls is not None:
            port = server.add_secure_port(bind.address, bind.tls.grpc_credentials())
        else:
            port = server.add_insecure_port(bind.address)
    except RuntimeError:  # grpc raises RuntimeError for a busy or invalid address
        port = 0
    if port == 0:
        await server.stop(None)
        raise OSError(f"could not bind the {service} gRPC server to {bind.address}; is the port free?")
    await server.start()
    for name in ("", *(s.name for s in services)):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    mode = "" if bind.tls is None else (" (mutual TLS)" if bind.tls.mutual else " (TLS)")
    logging.getLogger(f"spade.{service}.grpc").info("%s gRPC listening on %s:%d%s", service, bind.host, port, mode)
    try:
        yield RunningGrpc(port=port, server=server)
    finally:
        await health.enter_graceful_shutdown()
        await server.stop(grace=grace_s)
