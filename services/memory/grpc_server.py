"""The ``spade.v1.Memory`` gRPC servicer (grpc.aio): wire messages in, ``MemoryService`` calls, wire out.

Domain errors map to gRPC status codes in the shared interceptor (``spade.serving.grpc``), which also
logs internal failures and answers them ``INTERNAL`` without details (no tracebacks cross the wire),
and refuses a call whose key's role is below the method's in :data:`METHOD_ROLES` (``PERMISSION_DENIED``).
"""

from __future__ import annotations

import grpc
from pydantic import ValidationError

from services.memory.service import MemoryService
from spade.auth import Role
from spade.memory import wire
from spade.memory.errors import InvalidArgument
from spade.runspec import RunSpec
from spade.serving.grpc import GrpcService
from spade.v1 import memory_pb2 as pb
from spade.v1 import memory_pb2_grpc as pb_grpc

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Memory"].full_name
MAX_EXAMPLES = 100

METHOD_ROLES: dict[str, Role] = {
    "GetEnvironment": Role.READ,
    "ListEnvironments": Role.READ,
    "SampleExamples": Role.READ,
    "GetRunSpec": Role.READ,
    "PutEnvironment": Role.WRITE,
    "RecordPlays": Role.WRITE,
    "UpdateStats": Role.WRITE,
    "SetWindow": Role.WRITE,
    "RecordAttempts": Role.WRITE,
    "RecordProbe": Role.WRITE,
    "SetRunSpec": Role.ADMIN,  # the run's contract: the operator's `spade runspec set`, never a worker's key
}
"""The role each ``spade.v1.Memory`` method needs (a method missing here needs admin)."""


class MemoryServicer(pb_grpc.MemoryServicer):
    """Adapts ``MemoryService`` to the generated servicer interface."""

    def __init__(self, service: MemoryService) -> None:
        self._svc = service

    async def PutEnvironment(
        self, request: pb.PutEnvironmentRequest, context: grpc.aio.ServicerContext
    ) -> pb.PutEnvironmentResponse:
        res = await self._svc.put_environment(wire.new_env_from_pb(request.environment))
        return pb.PutEnvironmentResponse(env_id=res.env_id, duplicate_of=res.duplicate_of or "")

    async def GetEnvironment(
        self, request: pb.GetEnvironmentRequest, context: grpc.aio.ServicerContext
    ) -> pb.StoredEnvironment:
        return wire.env_to_pb(await self._svc.get_environment(request.env_id))

    async def ListEnvironments(
        self, request: pb.ListEnvironmentsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListEnvironmentsResponse:
        page = await self._svc.list_environments(
            wire.filter_from_pb(request), request.limit or 50, request.cursor or None
        )
        return pb.ListEnvironmentsResponse(
            environments=[wire.env_to_pb(e, include_code=request.include_code) for e in page.items],
            next_cursor=page.next_cursor or "",
        )

    async def RecordPlays(
        self, request: pb.RecordPlaysRequest, context: grpc.aio.ServicerContext
    ) -> pb.RecordPlaysResponse:
        res = await self._svc.record_plays([wire.play_from_pb(p) for p in request.plays])
        return pb.RecordPlaysResponse(recorded=res.recorded, duplicates=res.duplicates)

    async def UpdateStats(
        self, request: pb.UpdateStatsRequest, context: grpc.aio.ServicerContext
    ) -> pb.StoredEnvironment:
        env = await self._svc.update_stats(request.env_id, wire.update_from_pb(request))
        return wire.env_to_pb(env)

    async def SampleExamples(
        self, request: pb.SampleExamplesRequest, context: grpc.aio.ServicerContext
    ) -> pb.SampleExamplesResponse:
        for name in ("n_positive", "n_negative"):
            n = getattr(request, name)
            if not 0 <= n <= MAX_EXAMPLES:
                raise InvalidArgument(f"{name} {n} must be between 0 and {MAX_EXAMPLES}")
        seed = request.seed if request.HasField("seed") else None
        ex = await self._svc.sample_examples(
            wire.setting(request.setting), request.skill, request.n_positive, request.n_negative, seed
        )
        return wire.examples_to_pb(ex)

    async def SetWindow(self, request: pb.SetWindowRequest, context: grpc.aio.ServicerContext) -> pb.StoredEnvironment:
        env = await self._svc.set_window(request.env_id, request.window_start, request.window_versions)
        return wire.env_to_pb(env, include_code=False)

    async def RecordAttempts(
        self, request: pb.RecordAttemptsRequest, context: grpc.aio.ServicerContext
    ) -> pb.RecordAttemptsResponse:
        res = await self._svc.record_attempts([wire.attempt_from_pb(a) for a in request.attempts])
        return pb.RecordAttemptsResponse(recorded=res.recorded, duplicates=res.duplicates)

    async def GetRunSpec(self, request: pb.GetRunSpecRequest, context: grpc.aio.ServicerContext) -> pb.RunSpecRecord:
        return wire.runspec_to_pb(await self._svc.get_run_spec())

    async def RecordProbe(
        self, request: pb.RecordProbeRequest, context: grpc.aio.ServicerContext
    ) -> pb.RecordProbeResponse:
        await self._svc.record_probe(wire.probe_from_pb(request))
        return pb.RecordProbeResponse()

    async def SetRunSpec(self, request: pb.SetRunSpecRequest, context: grpc.aio.ServicerContext) -> pb.RunSpecRecord:
        try:
            spec = RunSpec.from_json(request.spec_json)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'spec'}: {e['msg']}" for e in exc.errors())
            raise InvalidArgument(f"spec_json is not a valid run spec: {problems}") from None
        return wire.runspec_to_pb(await self._svc.set_run_spec(spec, replace=request.replace))


def grpc_service(service: MemoryService) -> GrpcService:
    """The memory servicer, for ``spade.serving.grpc.grpc_server``."""
    servicer = MemoryServicer(service)
    return GrpcService(
        SERVICE_NAME, lambda server: pb_grpc.add_MemoryServicer_to_server(servicer, server), roles=METHOD_ROLES
    )
