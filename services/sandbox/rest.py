"""REST adapter (FastAPI): translates HTTP to ``SandboxService`` calls.

Errors, authentication, ``/healthz`` and ``/metrics`` are the shared ones of ``spade.serving.http``:
``/healthz`` answers ``ok`` to anyone, ``/healthz/details`` (pools, cgroups, versions) and ``/metrics``
(which name tenants) need a key (``read`` is enough). The ``/v1`` routes need a ``write`` key
(``SandboxService`` decides, for gRPC alike).
"""

from __future__ import annotations

import base64
import binascii
from typing import Any, Literal

from fastapi import Depends, FastAPI, Response
from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, StrictStr
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.sandbox.core.auth import Tenant
from services.sandbox.core.errors import InvalidRequest
from services.sandbox.core.requests import MAX_TURN_BUDGET
from services.sandbox.service import SandboxService
from spade.auth import Role
from spade.envs import StepOutcome, ValidationReport
from spade.envs.types import Setting
from spade.errors import require_text
from spade.serving.docs import install_offline_docs
from spade.serving.http import HttpMetrics, bearer_auth, error_response, install_error_handlers, ops_router


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


_BUDGET = (
    "The agent's turn budget (the run spec's agent_max_turns): solution() must win within it, and a longer "
    "episode is truncated at it. 0: the sandbox's configured budget."
)


class ValidateBody(_Strict):
    code: StrictStr = Field(description="Python source of one environment class.")
    setting: Setting = Field(Setting.GAME, description="Which contract the env follows.")
    agent_max_turns: StrictInt = Field(0, ge=0, le=MAX_TURN_BUDGET, description=_BUDGET)


class ExecuteBody(_Strict):
    code: StrictStr = Field(description="A Python program, run as __main__.")
    stdin: StrictStr = Field("", description="Standard input (text, or base64 when encoding is base64).")
    files: dict[str, StrictStr] = Field(
        default_factory=dict, description="Relative path → content, written to the working directory."
    )
    encoding: Literal["utf-8", "base64"] = Field(
        "utf-8", description="Encoding of stdin, files and of stdout/stderr in the response."
    )
    timeout_s: StrictFloat | StrictInt = Field(0, description="Wall-clock limit; 0 = service default.")
    memory_mb: StrictInt = Field(0, description="Address-space limit; 0 = service default.")


class OpenSessionBody(_Strict):
    code: StrictStr = Field(description="Python source of one environment class (loaded, then reset(seed)).")
    setting: Setting = Field(Setting.GAME, description="Which contract the env follows.")
    seed: StrictInt = Field(0, description="The seed reset() gets: the same seed gives the same instance.")
    agent_max_turns: StrictInt = Field(0, ge=0, le=MAX_TURN_BUDGET, description=_BUDGET)


class StepBody(_Strict):
    action: StrictStr = Field(
        description="The agent's reply: a \\boxed{...} command (game) or tool calls (tool), as in docs/environments.md."
    )


def outcome_json(outcome: StepOutcome, session_id: str | None = None) -> dict[str, Any]:
    body = outcome.to_dict()
    body["outcome"] = str(getattr(outcome.outcome, "value", outcome.outcome))
    if session_id is not None:
        body = {"session_id": session_id, **body}
    return body


def report_json(report: ValidationReport) -> dict[str, Any]:
    return report.to_dict()


def _decode(value: str, encoding: str, what: str) -> bytes:
    require_text(value, what, InvalidRequest)
    if encoding == "utf-8":
        return value.encode("utf-8")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidRequest(f"'{what}' is not valid base64: encode it or use encoding 'utf-8'") from exc


def _encode(value: bytes, encoding: str) -> str:
    if encoding == "utf-8":
        return value.decode("utf-8", errors="replace")
    return base64.b64encode(value).decode("ascii")


class BodyLimit:
    """ASGI middleware: refuse bodies over ``max_bytes`` with 413 before they are parsed."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(scope, receive, send)
            return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _BodyTooLarge
            return message

        try:
            await self.app(scope, limited, send)
        except _BodyTooLarge:
            await self._too_large(scope, receive, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(413, "payload_too_large", f"request body over {self.max_bytes} bytes: send less")
        await response(scope, receive, send)


class _BodyTooLarge(Exception):
    pass


def create_app(service: SandboxService, *, max_request_bytes: int) -> FastAPI:
    """Build the REST app around a running ``SandboxService``."""
    app = FastAPI(
        title="SPADE sandbox",
        version="1",
        description="Runs untrusted Python: environment validation, sessions, and plain execution. "
        "Send 'Authorization: Bearer <key>' on every /v1 call (docs/sandbox-client.md).",
        docs_url=None,
        redoc_url=None,
    )
    install_offline_docs(app)

    install_error_handlers(app, service="sandbox")
    tenant = bearer_auth(service.authenticator)

    @app.post("/v1/validate")
    async def validate(body: ValidateBody, who: Tenant = Depends(tenant)) -> dict[str, Any]:
        """Run every validation check on one environment and report each by name."""
        return report_json(await service.validate(who, body.code, body.setting, body.agent_max_turns))

    @app.post("/v1/execute")
    async def execute(body: ExecuteBody, who: Tenant = Depends(tenant)) -> dict[str, Any]:
        """Run a Python program with stdin, files and limits; report status, exit code and output."""
        stdin = _decode(body.stdin, body.encoding, "stdin")
        files = {path: _decode(content, body.encoding, f"files[{path[:40]}]") for path, content in body.files.items()}
        result = await service.execute(who, body.code, stdin, files, float(body.timeout_s), body.memory_mb)
        return {
            "status": str(getattr(result.status, "value", result.status)),
            "exit_code": result.exit_code,
            "stdout": _encode(result.stdout, body.encoding),
            "stderr": _encode(result.stderr, body.encoding),
            "duration_ms": result.duration_ms,
        }

    @app.post("/v1/sessions", status_code=201)
    async def open_session(body: OpenSessionBody, who: Tenant = Depends(tenant)) -> dict[str, Any]:
        """Load an environment and ``reset(seed)`` it; the reply carries the session id."""
        session_id, outcome = await service.open_session(who, body.code, body.setting, body.seed, body.agent_max_turns)
        return outcome_json(outcome, session_id)

    @app.post("/v1/sessions/{session_id}/step")
    async def step(session_id: str, body: StepBody, who: Tenant = Depends(tenant)) -> dict[str, Any]:
        """Send one action to a live session."""
        return outcome_json(await service.step(who, session_id, body.action), session_id)

    @app.delete("/v1/sessions/{session_id}", status_code=204)
    async def close(session_id: str, who: Tenant = Depends(tenant)) -> Response:
        """Close a session and free its process."""
        await service.close_session(who, session_id)
        return Response(status_code=204)

    async def health() -> tuple[bool, dict[str, Any]]:
        return True, service.health()

    keys = service.authenticator
    ops = (
        None
        if keys.open
        else bearer_auth(keys, role=Role.READ, action="reading the sandbox's health details and metrics")
    )
    app.include_router(ops_router(health=health, registry=service.metrics.registry, guard=ops))
    app.add_middleware(HttpMetrics, service="sandbox", registry=service.metrics.registry)
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)
    return app
