"""gRPC adapter: ``spade.v1.Sandbox`` over ``SandboxService``.

Authentication (the caller is :func:`spade.serving.grpc.caller`) and the mapping of domain errors to
status codes are the shared interceptor's (``spade.serving.grpc``); this module only translates.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from services.sandbox.core.auth import Tenant
from services.sandbox.core.errors import InvalidRequest, SandboxServiceError
from services.sandbox.service import SandboxService
from spade.sandbox.wire import execution_message, report_message, requested_setting, state_message
from spade.serving.grpc import GrpcService, caller
from spade.v1 import sandbox_pb2, sandbox_pb2_grpc

SERVICE_NAME = sandbox_pb2.DESCRIPTOR.services_by_name["Sandbox"].full_name


class SandboxServicer(sandbox_pb2_grpc.SandboxServicer):
    """Thin translation layer; every rule lives in ``SandboxService``."""

    def __init__(self, service: SandboxService) -> None:
        self.service = service

    @staticmethod
    def _tenant() -> Tenant:
        who = caller()
        assert isinstance(who, Tenant), "the sandbox's gRPC server authenticates every call"
        return who

    async def Validate(self, request: sandbox_pb2.ValidateRequest, context: Any) -> sandbox_pb2.ValidationReport:
        return report_message(
            await self.service.validate(
                self._tenant(), request.code, requested_setting(request.setting), request.agent_max_turns
            )
        )

    async def Execute(self, request: sandbox_pb2.ExecuteRequest, context: Any) -> sandbox_pb2.ExecuteResult:
        files: dict[str, bytes] = {}
        for f in request.files:
            if f.path in files:
                raise InvalidRequest(f"file {f.path[:80]!r} sent twice: send each path once")
            files[f.path] = f.content
        result = await self.service.execute(
            self._tenant(), request.code, request.stdin, files, request.timeout_s, int(request.memory_mb)
        )
        return execution_message(result)

    async def OpenSession(self, request: sandbox_pb2.OpenSessionRequest, context: Any) -> sandbox_pb2.SessionState:
        session_id, outcome = await self.service.open_session(
            self._tenant(), request.code, requested_setting(request.setting), request.seed, request.agent_max_turns
        )
        return state_message(session_id, outcome)

    async def Step(self, request: sandbox_pb2.StepRequest, context: Any) -> sandbox_pb2.SessionState:
        outcome = await self.service.step(self._tenant(), request.session_id, request.action)
        return state_message(request.session_id, outcome)

    async def CloseSession(
        self, request: sandbox_pb2.CloseSessionRequest, context: Any
    ) -> sandbox_pb2.CloseSessionResponse:
        await self.service.close_session(self._tenant(), request.session_id)
        return sandbox_pb2.CloseSessionResponse(closed=True)

    async def Play(
        self, request_iterator: AsyncIterator[sandbox_pb2.PlayRequest], context: Any
    ) -> AsyncIterator[sandbox_pb2.PlayResponse]:
        """The first message opens the session, each later one steps it; the stream's end closes it."""
        who = self._tenant()  # authenticated by the interceptor once the first message was in
        session_id: str | None = None
        try:
            async for message in request_iterator:
                kind = message.WhichOneof("kind")
                if session_id is None:
                    if kind != "open":
                        raise InvalidRequest("the first Play message must be 'open' with code, setting and seed")
                    opened = message.open
                    session_id, outcome = await self.service.open_session(
                        who, opened.code, requested_setting(opened.setting), opened.seed, opened.agent_max_turns
                    )
                elif kind == "action":
                    outcome = await self.service.step(who, session_id, message.action)
                else:
                    raise InvalidRequest("this Play stream already has a session: send 'action' messages")
                yield sandbox_pb2.PlayResponse(state=state_message(session_id, outcome))
        finally:
            if session_id is not None:
                with contextlib.suppress(SandboxServiceError):
                    await self.service.close_session(who, session_id)


def grpc_service(service: SandboxService) -> GrpcService:
    """The sandbox servicer, for ``spade.serving.grpc.grpc_server``."""
    servicer = SandboxServicer(service)
    return GrpcService(SERVICE_NAME, lambda server: sandbox_pb2_grpc.add_SandboxServicer_to_server(servicer, server))
