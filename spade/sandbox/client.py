"""The sandbox service's gRPC client: one for every caller.

- **Sessions** (the rollout): one session is one bidirectional ``Play`` stream. The session lives as
  long as the stream, which keeps it on one sandbox replica behind a load balancer.
- **Validate** (the designer, ``spade envs seed``) and **Execute** (plain code execution): unary calls
  answering the domain's ``ValidationReport`` and ``ExecutionResult``.

Failures are domain errors, never gRPC ones: a transient status (the replica went away, the stream
broke) is retried under the client's :class:`spade.retry.RetryPolicy` and, once the tries are spent,
raised as :class:`SandboxFault` (the caller retries the work elsewhere; it is never mistaken for the
env's own error). A refusal (a wrong key, a request over the sandbox's limits) raises
:class:`SandboxRefused` at once, naming what to fix.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from types import TracebackType
from typing import Any, Self

import grpc

from spade.endpoints import SandboxEndpoint
from spade.envs import StepOutcome, ValidationReport
from spade.grpc_channels import client_options
from spade.retry import RetryPolicy
from spade.sandbox.errors import SandboxFault, SandboxRefused
from spade.sandbox.execution import ExecutionResult
from spade.sandbox.wire import execution_from_message, report_from_message, setting_message, state_outcome
from spade.serving.errors import ERROR_CODE_TRAILER
from spade.serving.logs import get_logger
from spade.serving.tls import ClientTls, secure_channel
from spade.v1 import sandbox_pb2, sandbox_pb2_grpc

log = get_logger(__name__)

_EOF = grpc.aio.EOF  # type: ignore[attr-defined]  # the stubs lack it; the stream's end marker

TRANSIENT = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.CANCELLED,
    }
)
"""Statuses that say the sandbox (or the way to it) failed, not that it refused: worth another try.

INTERNAL is here because grpc.aio sometimes reports a server's immediate verdict (a bad key, say) as
INTERNAL when the verdict races the open request; a retry then reads the real one.
"""

DEFAULT_RETRY = RetryPolicy(attempts=3, initial_s=0.05, multiplier=2.0, max_s=1.0, jitter_s=0.05)
"""Tries of one call on transient statuses before ``SandboxFault`` (quick: a healthy replica answers at once)."""


def domain_error(exc: grpc.RpcError, what: str) -> SandboxFault | SandboxRefused:
    """The domain error for a failed call: a fault when transient, else a refusal naming the fix.

    RESOURCE_EXHAUSTED is a quota (retried, later) only with a ``retry-after`` trailer; without one it
    is a request over a size limit (the ``error-code`` trailer says ``payload_too_large``, or gRPC's own
    message-size limit refused it): sending it again cannot help.
    """
    code: grpc.StatusCode = exc.code()
    details = exc.details()
    pairs: Any = exc.trailing_metadata() or ()  # (key, value) pairs (the stubs type them otherwise)
    trailers = {str(key): value for key, value in pairs}
    over_a_limit = code == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry-after" not in trailers
    if code in TRANSIENT and not over_a_limit:
        return SandboxFault(f"sandbox gRPC {code.name} during {what}: {details}")
    refusal = f" {trailers[ERROR_CODE_TRAILER]}" if ERROR_CODE_TRAILER in trailers else ""
    return SandboxRefused(
        f"the sandbox refused the {what} ({code.name}{refusal}: {details}); check this caller's sandbox API key "
        "and the sandbox's limits"
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


async def _end(call: Any, outbox: asyncio.Queue[sandbox_pb2.PlayRequest | None]) -> None:
    """Finish the request iterator first (gRPC cannot close it while it waits), then the call."""
    await outbox.put(None)
    await asyncio.sleep(0)
    call.cancel()


class SandboxSession:
    """One env session on a ``Play`` stream (opened by :meth:`SandboxClient.open_session`).

    Attributes:
        initial: The env's answer to ``reset(seed)``.
    """

    def __init__(self, call: Any, outbox: asyncio.Queue[sandbox_pb2.PlayRequest | None], initial: StepOutcome) -> None:
        self._call = call
        self._outbox = outbox
        self.initial = initial

    async def step(self, action: str) -> StepOutcome:
        """Send one action and wait for the env's answer.

        Raises:
            SandboxFault: The stream broke or ended mid-session (not retried here: the env's state
                is gone with the stream, so the caller replays the whole episode).
            SandboxRefused: The sandbox refused the action (over its size limit, say).
        """
        await self._outbox.put(sandbox_pb2.PlayRequest(action=action))
        try:
            response = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            raise domain_error(exc, "session") from exc
        if response is _EOF:
            raise SandboxFault("the sandbox closed the Play stream mid-session")
        return state_outcome(response.state)

    async def close(self) -> None:
        """End the stream (the sandbox closes the session)."""
        await _end(self._call, self._outbox)


class SandboxClient:
    """The sandbox service over gRPC.

    Args:
        target: ``host:port`` of the sandbox's gRPC server.
        api_key: This caller's tenant key (sent as ``authorization: Bearer …``); None only against
            a dev-mode sandbox.
        timeout_s: Deadline of one ``Validate`` or ``Execute`` call.
        open_timeout_s: Longest wait for a session to open.
        retry: Tries of one call (or one session open) on transient statuses.
        tls: Reach the sandbox over TLS (its CA; a client certificate for mutual TLS); ``None``: plaintext.
    """

    def __init__(
        self,
        target: str,
        api_key: str | None = None,
        *,
        timeout_s: float = 120.0,
        open_timeout_s: float = 60.0,
        retry: RetryPolicy = DEFAULT_RETRY,
        tls: ClientTls | None = None,
    ) -> None:
        if timeout_s <= 0 or open_timeout_s <= 0:
            raise ValueError(f"timeouts must be positive, got timeout_s={timeout_s}, open_timeout_s={open_timeout_s}")
        self.target = target
        self._channel = secure_channel(target, tls, client_options())
        self._stub = sandbox_pb2_grpc.SandboxStub(self._channel)
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self._timeout_s = timeout_s
        self._open_timeout_s = open_timeout_s
        self._retry = retry

    @classmethod
    def from_endpoint(cls, endpoint: SandboxEndpoint) -> Self:
        """A client for a service's ``sandbox`` settings section (target, key, deadlines, retry, TLS)."""
        return cls(
            endpoint.target,
            endpoint.key(),
            timeout_s=endpoint.timeout_s,
            open_timeout_s=endpoint.open_timeout_s,
            retry=endpoint.retry,
            tls=endpoint.tls,
        )

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the channel (open sessions end with it)."""
        await self._channel.close(grace=None)

    # ---- unary calls ------------------------------------------------------------------------------

    async def _unary(self, what: str, method: Any, request: Any) -> Any:
        async for attempt in self._retry.async_retrying(SandboxFault, logger=log, what=f"sandbox {what}"):
            with attempt:
                try:
                    return await method(request, metadata=self._metadata, timeout=self._timeout_s)
                except grpc.aio.AioRpcError as exc:
                    raise domain_error(exc, what) from exc
        raise AssertionError("unreachable: the retryer re-raises the last failure")

    async def validate(self, code: str, setting: str, *, agent_max_turns: int = 0) -> ValidationReport:
        """Run the validation pipeline (DESIGN §4) on ``code`` as an environment of ``setting``.

        A report with failed checks is an answer, not an error.

        Args:
            code: The env's source.
            setting: ``"game"`` or ``"tool"``.
            agent_max_turns: The agent's turn budget (the run spec's): ``solution()`` must win within
                it and a longer declared ``max_turns`` is clamped. 0: the sandbox's configured budget.

        Raises:
            SandboxFault: The sandbox stayed unreachable or failing for every try.
            SandboxRefused: The sandbox refused the request (key, size limits).
        """
        request = sandbox_pb2.ValidateRequest(
            code=code, setting=setting_message(setting), agent_max_turns=agent_max_turns
        )
        return report_from_message(await self._unary("validation", self._stub.Validate, request))

    async def execute(
        self,
        code: str,
        *,
        stdin: bytes = b"",
        files: Mapping[str, bytes] | None = None,
        timeout_s: float = 0.0,
        memory_mb: int = 0,
    ) -> ExecutionResult:
        """Run ``code`` as a plain Python program in a fresh jail.

        Args:
            code: The program's source.
            stdin: Its standard input.
            files: Files placed in its private working directory (relative path -> content).
            timeout_s: Its wall-clock limit (0: the sandbox's default; above its maximum is refused).
            memory_mb: Its memory limit (0: the sandbox's default).

        Raises:
            SandboxFault: The sandbox stayed unreachable or failing for every try.
            SandboxRefused: The sandbox refused the request (key, size or time limits).
        """
        request = sandbox_pb2.ExecuteRequest(
            code=code,
            stdin=stdin,
            files=[sandbox_pb2.ExecuteFile(path=path, content=content) for path, content in (files or {}).items()],
            timeout_s=timeout_s,
            memory_mb=memory_mb,
        )
        return execution_from_message(await self._unary("execution", self._stub.Execute, request))

    # ---- sessions ---------------------------------------------------------------------------------

    async def open_session(self, code: str, setting: str, seed: int, *, agent_max_turns: int = 0) -> SandboxSession:
        """Open a ``Play`` stream and ``reset(seed)`` the env on it.

        A failed open leaves nothing behind: the stream's end closes it. ``agent_max_turns``: the turn
        at which the session truncates (outcome ``limit``) unless the env's own ``max_turns`` is lower;
        0: the sandbox's configured budget.

        Raises:
            SandboxFault: No session opened within the tries (unreachable, timed out, stream ended).
            SandboxRefused: The sandbox refused the session (key, quota of this tenant, size limits).
        """
        async for attempt in self._retry.async_retrying(SandboxFault, logger=log, what="opening a sandbox session"):
            with attempt:
                return await self._open(code, setting, seed, agent_max_turns)
        raise AssertionError("unreachable: the retryer re-raises the last failure")

    async def _open(self, code: str, setting: str, seed: int, agent_max_turns: int) -> SandboxSession:
        outbox: asyncio.Queue[sandbox_pb2.PlayRequest | None] = asyncio.Queue()
        open_request = sandbox_pb2.OpenSessionRequest(
            code=code, setting=setting_message(setting), seed=seed, agent_max_turns=agent_max_turns
        )
        await outbox.put(sandbox_pb2.PlayRequest(open=open_request))
        call = self._stub.Play(_requests(outbox), metadata=self._metadata)
        try:
            response = await asyncio.wait_for(call.read(), self._open_timeout_s)
        except TimeoutError as exc:
            await _end(call, outbox)
            raise SandboxFault(f"the sandbox did not open a session within {self._open_timeout_s}s") from exc
        except grpc.aio.AioRpcError as exc:
            await _end(call, outbox)
            raise domain_error(exc, "session") from exc
        if response is _EOF:
            await _end(call, outbox)
            raise SandboxFault("the sandbox closed the Play stream before the session opened")
        return SandboxSession(call, outbox, state_outcome(response.state))
