"""Env sessions for the episode loop: the isolated pool in-process, or the sandbox service over gRPC.

Both give the core's ``SessionOpener``. Over gRPC one session is one bidirectional ``Play`` stream
(the session lives as long as the stream, which keeps it on one sandbox replica behind a load
balancer). Transport failures become ``SandboxFault`` so the worker retries the play elsewhere;
they are never mistaken for the env's own errors.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any, Protocol

import grpc

from services.rollout.core.ports import SandboxFault
from spade.envs import CheckConfig, Outcome, StepOutcome
from spade.v1 import sandbox_pb2, sandbox_pb2_grpc

_EOF = grpc.aio.EOF  # type: ignore[attr-defined]  # the stubs lack it; the stream's end marker

_RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.CANCELLED,
}


class _Pool(Protocol):
    async def open_session(self, code: str, setting: str, seed: int, config: CheckConfig) -> Any: ...


class PoolSessions:
    """The sandbox's isolated worker pool, used in-process (embedded mode).

    Args:
        pool: A started ``services.sandbox.isolation.SandboxPool``.
        checks: Limits sessions enforce (turn cap, observation size, call time).
    """

    def __init__(self, pool: _Pool, checks: CheckConfig | None = None) -> None:
        self._pool = pool
        self._checks = checks or CheckConfig()

    async def open_session(self, code: str, setting: str, seed: int) -> Any:
        """Load ``code`` in a fresh jail and ``reset(seed)`` it."""
        return await self._pool.open_session(code, setting, seed, self._checks)


def state_outcome(state: sandbox_pb2.SessionState) -> StepOutcome:
    """A ``SessionState`` from the wire as a ``StepOutcome`` (an unknown verdict counts as a sandbox fault)."""
    try:
        info = json.loads(state.info_json) if state.info_json else {}
    except json.JSONDecodeError:
        info = {}
    try:
        outcome = Outcome(state.outcome or "ok")
    except ValueError:
        outcome = Outcome.SANDBOX_FAULT
    return StepOutcome(
        observation=state.observation,
        reward=state.reward,
        terminated=state.terminated,
        truncated=state.truncated,
        info=info if isinstance(info, dict) else {},
        turn=state.turn,
        max_turns=state.max_turns,
        outcome=outcome,
    )


async def _requests(outbox: asyncio.Queue[sandbox_pb2.PlayRequest | None]) -> AsyncIterator[sandbox_pb2.PlayRequest]:
    """The stream's requests, fed by the session (None ends the stream).

    gRPC sends them from its own request iterator: a ``write`` racing the server's early abort would
    otherwise fail locally with "Internal error from Core" and hide the server's real status.
    """
    while True:
        item = await outbox.get()
        if item is None:
            return
        yield item


class GrpcSession:
    """One env session on a ``Play`` stream."""

    def __init__(self, call: Any, outbox: asyncio.Queue[sandbox_pb2.PlayRequest | None], initial: StepOutcome) -> None:
        self._call = call
        self._outbox = outbox
        self.initial = initial

    async def step(self, action: str) -> StepOutcome:
        """Send one action and wait for the env's answer."""
        await self._outbox.put(sandbox_pb2.PlayRequest(action=action))
        try:
            response = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            raise _fault(exc.code(), exc.details()) from exc
        if response is _EOF:
            raise SandboxFault("the sandbox closed the Play stream mid-session")
        return state_outcome(response.state)

    async def close(self) -> None:
        """End the stream (the sandbox closes the session)."""
        await _end(self._call, self._outbox)


async def _end(call: Any, outbox: asyncio.Queue[sandbox_pb2.PlayRequest | None]) -> None:
    """Finish the request iterator first (gRPC cannot close it while it waits), then the call."""
    await outbox.put(None)
    await asyncio.sleep(0)
    call.cancel()


def _fault(code: grpc.StatusCode, details: str | None) -> Exception:
    if code in _RETRYABLE:
        return SandboxFault(f"sandbox gRPC {code.name}: {details}")
    return RuntimeError(
        f"the sandbox refused the session ({code.name}: {details}); check the rollout's "
        "sandbox API key and the sandbox's limits"
    )


class GrpcSandboxSessions:
    """Sessions on the sandbox service (distributed mode).

    Args:
        target: ``host:port`` of the sandbox's gRPC server.
        api_key: The rollout's tenant key (sent as ``authorization: Bearer …``); None in dev mode.
        open_timeout_s: Longest wait for a session to open.
        open_attempts: Tries of one open on transient statuses before ``SandboxFault``.
    """

    def __init__(
        self, target: str, api_key: str | None = None, *, open_timeout_s: float = 60.0, open_attempts: int = 3
    ) -> None:
        if open_attempts < 1:
            raise ValueError(f"open_attempts must be >= 1, got {open_attempts}")
        self._open_attempts = open_attempts
        self._channel = grpc.aio.insecure_channel(target)
        self._stub = sandbox_pb2_grpc.SandboxStub(self._channel)
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self._open_timeout_s = open_timeout_s

    async def open_session(self, code: str, setting: str, seed: int) -> GrpcSession:
        """Open a ``Play`` stream and reset the env on it.

        Opening is retried on transient statuses: grpc.aio sometimes reports a server's immediate
        verdict (a bad key, say) as INTERNAL when the verdict races the open request, and a retry
        then reads the real one. A failed open leaves nothing behind: the stream's end closes it.
        """
        for attempt in range(1, self._open_attempts + 1):
            try:
                return await self._open(code, setting, seed)
            except SandboxFault:
                if attempt == self._open_attempts:
                    raise
                await asyncio.sleep(0.05 * attempt)
        raise AssertionError("unreachable")

    async def _open(self, code: str, setting: str, seed: int) -> GrpcSession:
        outbox: asyncio.Queue[sandbox_pb2.PlayRequest | None] = asyncio.Queue()
        open_request = sandbox_pb2.OpenSessionRequest(code=code, setting=setting, seed=seed)
        await outbox.put(sandbox_pb2.PlayRequest(open=open_request))
        call = self._stub.Play(_requests(outbox), metadata=self._metadata)
        try:
            response = await asyncio.wait_for(call.read(), self._open_timeout_s)
        except TimeoutError as exc:
            await _end(call, outbox)
            raise SandboxFault(f"the sandbox did not open a session within {self._open_timeout_s}s") from exc
        except grpc.aio.AioRpcError as exc:
            await _end(call, outbox)
            raise _fault(exc.code(), exc.details()) from exc
        if response is _EOF:
            await _end(call, outbox)
            raise SandboxFault("the sandbox closed the Play stream before the session opened")
        return GrpcSession(call, outbox, state_outcome(response.state))

    async def close(self) -> None:
        """Close the channel."""
        await self._channel.close(grace=None)
