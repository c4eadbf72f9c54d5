"""The sandbox service's gRPC client for code that does not run an event loop: the same calls as
:class:`spade.sandbox.client.SandboxClient`, blocking.

>>> from spade.sandbox.sync_client import SyncSandboxClient
>>> with SyncSandboxClient("127.0.0.1:50051", api_key="...") as sandbox:  # doctest: +SKIP
...     result = sandbox.execute("print(6 * 7)")
...     result.status.value, result.stdout
('ok', b'42\\n')

Errors are the same domain errors: :class:`SandboxFault` (the sandbox or the way to it failed,
after the retry policy's tries; retry elsewhere or later) and :class:`SandboxRefused` (the request
was refused: a wrong key, a quota, a limit; the message says what to fix).
"""

from __future__ import annotations

import queue
from collections.abc import Iterator, Mapping
from types import TracebackType
from typing import Any, Self

import grpc

from spade.envs import StepOutcome, ValidationReport
from spade.retry import RetryPolicy
from spade.sandbox.client import DEFAULT_RETRY, domain_error
from spade.sandbox.errors import SandboxFault
from spade.sandbox.execution import ExecutionResult
from spade.sandbox.wire import execution_from_message, report_from_message, setting_message, state_outcome
from spade.serving.logs import get_logger
from spade.serving.tls import ClientTls, secure_sync_channel
from spade.v1 import sandbox_pb2, sandbox_pb2_grpc

log = get_logger(__name__)


def _requests(outbox: queue.SimpleQueue[sandbox_pb2.PlayRequest | None]) -> Iterator[sandbox_pb2.PlayRequest]:
    while (item := outbox.get()) is not None:
        yield item


class SyncSandboxSession:
    """One env session on a ``Play`` stream (opened by :meth:`SyncSandboxClient.open_session`).

    Use it as a context manager, or call :meth:`close`; the session ends with its stream.

    Attributes:
        initial: The env's answer to ``reset(seed)``.
    """

    def __init__(
        self, call: Any, outbox: queue.SimpleQueue[sandbox_pb2.PlayRequest | None], initial: StepOutcome
    ) -> None:
        self._call = call
        self._outbox = outbox
        self.initial = initial

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def step(self, action: str) -> StepOutcome:
        """Send one action and wait for the env's answer.

        Raises:
            SandboxFault: The stream broke or ended mid-session (not retried: the env's state is gone
                with it, so replay the episode).
            SandboxRefused: The sandbox refused the action (over its size limit, say).
        """
        self._outbox.put(sandbox_pb2.PlayRequest(action=action))
        try:
            response = next(self._call)
        except StopIteration:
            raise SandboxFault("the sandbox closed the Play stream mid-session") from None
        except grpc.RpcError as exc:
            raise domain_error(exc, "session") from exc
        return state_outcome(response.state)

    def close(self) -> None:
        """End the stream (the sandbox closes the session)."""
        self._outbox.put(None)
        self._call.cancel()


class SyncSandboxClient:
    """The sandbox service over gRPC, blocking.

    Args:
        target: ``host:port`` of the sandbox's gRPC server.
        api_key: This caller's tenant key (sent as ``authorization: Bearer …``); None only against
            a dev-mode sandbox.
        timeout_s: Deadline of one ``Validate`` or ``Execute`` call.
        retry: Tries of one call (or one session open) on transient statuses.
        tls: Reach the sandbox over TLS (its CA; a client certificate for mutual TLS); ``None``: plaintext.
    """

    def __init__(
        self,
        target: str,
        api_key: str | None = None,
        *,
        timeout_s: float = 120.0,
        retry: RetryPolicy = DEFAULT_RETRY,
        tls: ClientTls | None = None,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.target = target
        self._channel = secure_sync_channel(target, tls)
        self._stub = sandbox_pb2_grpc.SandboxStub(self._channel)
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self._timeout_s = timeout_s
        self._retry = retry

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close the channel (open sessions end with it)."""
        self._channel.close()

    def _unary(self, what: str, method: Any, request: Any) -> Any:
        for attempt in self._retry.retrying(SandboxFault, logger=log, what=f"sandbox {what}"):
            with attempt:
                try:
                    return method(request, metadata=self._metadata, timeout=self._timeout_s)
                except grpc.RpcError as exc:
                    raise domain_error(exc, what) from exc
        raise AssertionError("unreachable: the retryer re-raises the last failure")

    def validate(self, code: str, setting: str, *, agent_max_turns: int = 0) -> ValidationReport:
        """Run the validation pipeline on ``code`` (see :meth:`SandboxClient.validate`)."""
        request = sandbox_pb2.ValidateRequest(
            code=code, setting=setting_message(setting), agent_max_turns=agent_max_turns
        )
        return report_from_message(self._unary("validation", self._stub.Validate, request))

    def execute(
        self,
        code: str,
        *,
        stdin: bytes = b"",
        files: Mapping[str, bytes] | None = None,
        timeout_s: float = 0.0,
        memory_mb: int = 0,
    ) -> ExecutionResult:
        """Run ``code`` as a plain Python program in a fresh jail (see :meth:`SandboxClient.execute`)."""
        request = sandbox_pb2.ExecuteRequest(
            code=code,
            stdin=stdin,
            files=[sandbox_pb2.ExecuteFile(path=path, content=content) for path, content in (files or {}).items()],
            timeout_s=timeout_s,
            memory_mb=memory_mb,
        )
        return execution_from_message(self._unary("execution", self._stub.Execute, request))

    def open_session(self, code: str, setting: str, seed: int, *, agent_max_turns: int = 0) -> SyncSandboxSession:
        """Open a ``Play`` stream and ``reset(seed)`` the env on it (the sandbox bounds how long that
        takes: its ``session_start_seconds``).

        Raises:
            SandboxFault: No session opened within the tries.
            SandboxRefused: The sandbox refused the session (key, this tenant's quota, size limits).
        """
        for attempt in self._retry.retrying(SandboxFault, logger=log, what="opening a sandbox session"):
            with attempt:
                outbox: queue.SimpleQueue[sandbox_pb2.PlayRequest | None] = queue.SimpleQueue()
                open_request = sandbox_pb2.OpenSessionRequest(
                    code=code, setting=setting_message(setting), seed=seed, agent_max_turns=agent_max_turns
                )
                outbox.put(sandbox_pb2.PlayRequest(open=open_request))
                call = self._stub.Play(_requests(outbox), metadata=self._metadata)
                try:
                    response = next(call)
                except StopIteration:
                    outbox.put(None)
                    raise SandboxFault("the sandbox closed the Play stream before the session opened") from None
                except grpc.RpcError as exc:
                    outbox.put(None)
                    call.cancel()
                    raise domain_error(exc, "session") from exc
                return SyncSandboxSession(call, outbox, state_outcome(response.state))
        raise AssertionError("unreachable: the retryer re-raises the last failure")
