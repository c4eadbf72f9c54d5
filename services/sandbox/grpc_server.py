"""gRPC adapter: ``spade.v1.Sandbox`` over ``SandboxService``; errors map to status codes here only."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from services.sandbox.core.auth import Tenant
from services.sandbox.core.errors import InvalidRequest, SandboxServiceError
from services.sandbox.service import SandboxService
from spade.envs import StepOutcome, ValidationReport
from spade.v1 import sandbox_pb2, sandbox_pb2_grpc

T = TypeVar("T")


def state_message(session_id: str, outcome: StepOutcome) -> sandbox_pb2.SessionState:
    return sandbox_pb2.SessionState(
        session_id=session_id,
        observation=outcome.observation,
        reward=float(outcome.reward),
        terminated=bool(outcome.terminated),
        truncated=bool(outcome.truncated),
        info_json=json.dumps(outcome.info, default=str),
        turn=int(outcome.turn),
        max_turns=int(outcome.max_turns),
        outcome=str(getattr(outcome.outcome, "value", outcome.outcome)),
    )


def report_message(report: ValidationReport) -> sandbox_pb2.ValidationReport:
    return sandbox_pb2.ValidationReport(
        valid=report.valid,
        setting=str(getattr(report.setting, "value", report.setting)),
        env_class=report.env_class or "",
        checks=[sandbox_pb2.CheckResult(name=c.name, passed=c.passed, detail=c.detail) for c in report.checks],
        repaired_code=report.repaired_code or "",
        duration_ms=float(getattr(report, "duration_ms", 0.0) or 0.0),
    )


class SandboxServicer(sandbox_pb2_grpc.SandboxServicer):
    """Thin translation layer; every rule lives in ``SandboxService``."""

    def __init__(self, service: SandboxService) -> None:
        self.service = service

    def _tenant(self, context: grpc.aio.ServicerContext) -> Tenant:
        metadata = dict(context.invocation_metadata() or ())
        value = metadata.get("authorization")
        return self.service.authenticate(value if isinstance(value, str) else None)

    async def _call(self, context: grpc.aio.ServicerContext, fn: Callable[[Tenant], Awaitable[T]]) -> T:
        try:
            return await fn(self._tenant(context))
        except SandboxServiceError as exc:
            await context.abort(exc.grpc_status, str(exc))
        except Exception:
            await context.abort(grpc.StatusCode.INTERNAL, "internal error in the sandbox service")
        raise AssertionError("unreachable: abort raises")

    async def Validate(self, request: sandbox_pb2.ValidateRequest, context: Any) -> sandbox_pb2.ValidationReport:
        async def run(who: Tenant) -> sandbox_pb2.ValidationReport:
            return report_message(await self.service.validate(who, request.code, request.setting or "game"))

        return await self._call(context, run)

    async def Execute(self, request: sandbox_pb2.ExecuteRequest, context: Any) -> sandbox_pb2.ExecuteResult:
        async def run(who: Tenant) -> sandbox_pb2.ExecuteResult:
            files: dict[str, bytes] = {}
            for f in request.files:
                if f.path in files:
                    raise InvalidRequest(f"file {f.path[:80]!r} sent twice: send each path once")
                files[f.path] = f.content
            result = await self.service.execute(
                who, request.code, request.stdin, files, request.timeout_s, int(request.memory_mb)
            )
            return sandbox_pb2.ExecuteResult(
                status=str(getattr(result.status, "value", result.status)),
                exit_code=int(result.exit_code if result.exit_code is not None else -1),
                stdout=result.stdout,
                stderr=result.stderr,
                duration_ms=float(result.duration_ms),
            )

        return await self._call(context, run)

    async def OpenSession(self, request: sandbox_pb2.OpenSessionRequest, context: Any) -> sandbox_pb2.SessionState:
        async def run(who: Tenant) -> sandbox_pb2.SessionState:
            session_id, outcome = await self.service.open_session(
                who, request.code, request.setting or "game", request.seed
            )
            return state_message(session_id, outcome)

        return await self._call(context, run)

    async def Step(self, request: sandbox_pb2.StepRequest, context: Any) -> sandbox_pb2.SessionState:
        async def run(who: Tenant) -> sandbox_pb2.SessionState:
            return state_message(request.session_id, await self.service.step(who, request.session_id, request.action))

        return await self._call(context, run)

    async def CloseSession(
        self, request: sandbox_pb2.CloseSessionRequest, context: Any
    ) -> sandbox_pb2.CloseSessionResponse:
        async def run(who: Tenant) -> sandbox_pb2.CloseSessionResponse:
            await self.service.close_session(who, request.session_id)
            return sandbox_pb2.CloseSessionResponse(closed=True)

        return await self._call(context, run)

    async def Play(
        self, request_iterator: AsyncIterator[sandbox_pb2.PlayRequest], context: Any
    ) -> AsyncIterator[sandbox_pb2.PlayResponse]:
        """The first message opens the session, each later one steps it; the stream's end closes it."""
        session_id: str | None = None
        who: Tenant | None = None
        try:
            async for message in request_iterator:
                kind = message.WhichOneof("kind")
                if who is None:
                    # Authenticate once the first message is in: an early abort before the client has
                    # sent anything surfaces in grpc.aio clients as an INTERNAL error instead of ours.
                    who = self._tenant(context)
                if session_id is None:
                    if kind != "open":
                        raise InvalidRequest("the first Play message must be 'open' with code, setting and seed")
                    session_id, outcome = await self.service.open_session(
                        who, message.open.code, message.open.setting or "game", message.open.seed
                    )
                elif kind == "action":
                    outcome = await self.service.step(who, session_id, message.action)
                else:
                    raise InvalidRequest("this Play stream already has a session: send 'action' messages")
                yield sandbox_pb2.PlayResponse(state=state_message(session_id, outcome))
        except SandboxServiceError as exc:
            await context.abort(exc.grpc_status, str(exc))
        finally:
            if session_id is not None and who is not None:
                with contextlib.suppress(SandboxServiceError):
                    await self.service.close_session(who, session_id)


def create_server(service: SandboxService, *, max_message_bytes: int) -> grpc.aio.Server:
    """Build (not start) the gRPC server; call ``add_insecure_port`` / ``start`` on it."""
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max(max_message_bytes, 64 * 2**20)),
        ]
    )
    sandbox_pb2_grpc.add_SandboxServicer_to_server(SandboxServicer(service), server)
    return server
