"""The ``spade.v1.Memory`` gRPC servicer (grpc.aio): wire messages in, ``MemoryService`` calls, wire out.

Domain errors map to gRPC status codes in ``_status`` and nowhere else; internal failures are logged
and reported as ``INTERNAL`` without details (no tracebacks cross the wire).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

from services.memory.service import MemoryService
from spade.memory import wire
from spade.memory.errors import EnvironmentNotFound, InvalidArgument
from spade.memory.wire import GRPC_OPTIONS
from spade.v1 import memory_pb2 as pb
from spade.v1 import memory_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
T = TypeVar("T")
MAX_EXAMPLES = 100


async def _status(context: grpc.aio.ServicerContext, call: Callable[[], Awaitable[T]]) -> T:
    try:
        return await call()
    except EnvironmentNotFound as exc:
        await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
    except InvalidArgument as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    except Exception:
        log.exception("memory RPC failed")
        await context.abort(grpc.StatusCode.INTERNAL, "internal error in the memory service; see its log")
    raise AssertionError("abort() always raises")


class MemoryServicer(pb_grpc.MemoryServicer):
    """Adapts ``MemoryService`` to the generated servicer interface."""

    def __init__(self, service: MemoryService) -> None:
        self._svc = service

    async def PutEnvironment(
        self, request: pb.PutEnvironmentRequest, context: grpc.aio.ServicerContext
    ) -> pb.PutEnvironmentResponse:
        async def call() -> pb.PutEnvironmentResponse:
            res = await self._svc.put_environment(wire.new_env_from_pb(request.environment))
            return pb.PutEnvironmentResponse(env_id=res.env_id, duplicate_of=res.duplicate_of or "")

        return await _status(context, call)

    async def GetEnvironment(
        self, request: pb.GetEnvironmentRequest, context: grpc.aio.ServicerContext
    ) -> pb.StoredEnvironment:
        async def call() -> pb.StoredEnvironment:
            return wire.env_to_pb(await self._svc.get_environment(request.env_id))

        return await _status(context, call)

    async def ListEnvironments(
        self, request: pb.ListEnvironmentsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListEnvironmentsResponse:
        async def call() -> pb.ListEnvironmentsResponse:
            page = await self._svc.list_environments(
                wire.filter_from_pb(request), request.limit or 50, request.cursor or None
            )
            return pb.ListEnvironmentsResponse(
                environments=[wire.env_to_pb(e, include_code=request.include_code) for e in page.items],
                next_cursor=page.next_cursor or "",
            )

        return await _status(context, call)

    async def RecordPlays(
        self, request: pb.RecordPlaysRequest, context: grpc.aio.ServicerContext
    ) -> pb.RecordPlaysResponse:
        async def call() -> pb.RecordPlaysResponse:
            res = await self._svc.record_plays([wire.play_from_pb(p) for p in request.plays])
            return pb.RecordPlaysResponse(recorded=res.recorded, duplicates=res.duplicates)

        return await _status(context, call)

    async def UpdateStats(
        self, request: pb.UpdateStatsRequest, context: grpc.aio.ServicerContext
    ) -> pb.StoredEnvironment:
        async def call() -> pb.StoredEnvironment:
            env = await self._svc.update_stats(request.env_id, wire.update_from_pb(request))
            return wire.env_to_pb(env)

        return await _status(context, call)

    async def SampleExamples(
        self, request: pb.SampleExamplesRequest, context: grpc.aio.ServicerContext
    ) -> pb.SampleExamplesResponse:
        async def call() -> pb.SampleExamplesResponse:
            for name in ("n_positive", "n_negative"):
                n = getattr(request, name)
                if not 0 <= n <= MAX_EXAMPLES:
                    raise InvalidArgument(f"{name} {n} must be between 0 and {MAX_EXAMPLES}")
            seed = request.seed if request.HasField("seed") else None
            ex = await self._svc.sample_examples(
                request.setting, request.skill, request.n_positive, request.n_negative, seed
            )
            return wire.examples_to_pb(ex)

        return await _status(context, call)


async def start_grpc(service: MemoryService, address: str = "127.0.0.1:0") -> tuple[grpc.aio.Server, int]:
    """Start a grpc.aio server for ``service`` on ``address``; returns it and the bound port.

    Raises:
        RuntimeError: The address could not be bound.
    """
    server = grpc.aio.server(options=GRPC_OPTIONS)
    pb_grpc.add_MemoryServicer_to_server(MemoryServicer(service), server)
    port = server.add_insecure_port(address)
    if port == 0:
        raise RuntimeError(f"could not bind the memory gRPC server to {address}; is the port free?")
    await server.start()
    return server, port
