"""``MemoryClient``: the ``MemoryService`` API over gRPC, for services in distributed mode.

It returns the same records as ``MemoryService`` and raises the same domain errors
(``EnvironmentNotFound``, ``InvalidArgument``, ``RunSpecNotSet``, ``RunSpecConflict``, and
``spade.auth.Unauthenticated`` for a missing or wrong key, ``spade.auth.Forbidden`` for a key whose
role does not allow the call), so callers do not care which one they
hold. It sends its tenant key as ``authorization: Bearer <key>`` on every call (the memory's gRPC
API requires one outside dev mode); build it from a service's ``memory`` settings section with
:meth:`MemoryClient.from_endpoint`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from spade.auth import Forbidden, Unauthenticated
from spade.grpc_channels import client_options
from spade.memory import wire
from spade.memory.errors import (
    EnvironmentNotFound,
    InvalidArgument,
    MemoryServiceError,
    MemoryUnavailable,
    RunSpecConflict,
    RunSpecNotSet,
)
from spade.memory.records import (
    DesignerAttempt,
    EnvFilter,
    Environment,
    EnvProbe,
    Examples,
    NewEnvironment,
    Page,
    Play,
    PutResult,
    RecordResult,
    RunSpecRecord,
    StatsUpdate,
)
from spade.memory.wire import GRPC_OPTIONS
from spade.runspec import RunSpec
from spade.serving.tls import ClientTls, secure_channel
from spade.v1 import memory_pb2 as pb
from spade.v1 import memory_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from spade.endpoints import MemoryEndpoint

T = TypeVar("T")


class MemoryClient:
    """Async client of ``spade.v1.Memory``.

    Args:
        target: ``host:port`` of the memory's gRPC server.
        timeout_s: Deadline of each call.
        api_key: This caller's tenant key (sent as ``authorization: Bearer …``); ``None`` only
            against a memory in dev mode without keys.
        tls: Reach the memory over TLS (its CA; a client certificate for mutual TLS); ``None``: plaintext.
    """

    def __init__(
        self, target: str, timeout_s: float = 30.0, api_key: str | None = None, *, tls: ClientTls | None = None
    ) -> None:
        self._channel = secure_channel(target, tls, client_options(*GRPC_OPTIONS))
        self._stub = pb_grpc.MemoryStub(self._channel)
        metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self._kw: dict[str, Any] = {"timeout": timeout_s, "metadata": metadata}

    @classmethod
    def from_endpoint(cls, endpoint: MemoryEndpoint) -> MemoryClient:
        """A client for a service's ``memory`` settings section (target, deadline, key, TLS)."""
        return cls(endpoint.target, timeout_s=endpoint.timeout_s, api_key=endpoint.key(), tls=endpoint.tls)

    async def _call(
        self, env_id: str, fn: Callable[[], Awaitable[T]], not_found: Callable[[str], Exception] | None = None
    ) -> T:
        try:
            return await fn()
        except grpc.aio.AioRpcError as exc:
            code, details = exc.code(), exc.details() or ""
            if code == grpc.StatusCode.NOT_FOUND:
                raise (not_found(details) if not_found else EnvironmentNotFound(env_id)) from None
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidArgument(details or "invalid argument") from None
            if code == grpc.StatusCode.FAILED_PRECONDITION:
                raise RunSpecConflict(details or "the request conflicts with the memory's state") from None
            if code == grpc.StatusCode.UNAUTHENTICATED:
                raise Unauthenticated(
                    f"the memory refused this service's key ({details}): set the memory section's api_key "
                    "to a key whose SHA-256 is in the memory's SPADE_MEMORY_API_KEYS"
                ) from None
            if code == grpc.StatusCode.PERMISSION_DENIED:
                raise Forbidden(
                    f"the memory refused this call to this service's key ({details}): give the key that role in "
                    "the memory's SPADE_MEMORY_API_KEYS"
                ) from None
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise MemoryUnavailable(f"memory RPC failed: {code.name}: {details}") from exc
            raise MemoryServiceError(f"memory RPC failed: {code.name}: {details}") from exc

    async def put_environment(self, env: NewEnvironment) -> PutResult:
        """See ``MemoryService.put_environment``."""
        req = pb.PutEnvironmentRequest(environment=wire.new_env_to_pb(env))
        res = await self._call("", lambda: self._stub.PutEnvironment(req, **self._kw))
        return PutResult(env_id=res.env_id, duplicate_of=res.duplicate_of or None)

    async def get_environment(self, env_id: str) -> Environment:
        """See ``MemoryService.get_environment``."""
        req = pb.GetEnvironmentRequest(env_id=env_id)
        return wire.env_from_pb(await self._call(env_id, lambda: self._stub.GetEnvironment(req, **self._kw)))

    async def list_environments(
        self, f: EnvFilter | None = None, limit: int = 50, cursor: str | None = None, *, include_code: bool = True
    ) -> Page:
        """See ``MemoryService.list_environments`` (``seq`` of returned records is 0)."""
        req = wire.filter_to_pb(f or EnvFilter())
        req.limit, req.cursor, req.include_code = limit, cursor or "", include_code
        res = await self._call("", lambda: self._stub.ListEnvironments(req, **self._kw))
        return Page(items=tuple(wire.env_from_pb(e) for e in res.environments), next_cursor=res.next_cursor or None)

    async def record_plays(self, plays: Sequence[Play]) -> RecordResult:
        """See ``MemoryService.record_plays``."""
        req = pb.RecordPlaysRequest(plays=[wire.play_to_pb(p) for p in plays])
        missing = next(iter(sorted({p.env_id for p in plays})), "")
        res = await self._call(missing, lambda: self._stub.RecordPlays(req, **self._kw))
        return RecordResult(recorded=res.recorded, duplicates=res.duplicates)

    async def update_stats(self, env_id: str, update: StatsUpdate) -> Environment:
        """See ``MemoryService.update_stats``."""
        req = wire.update_to_pb(env_id, update)
        return wire.env_from_pb(await self._call(env_id, lambda: self._stub.UpdateStats(req, **self._kw)))

    async def sample_examples(
        self, setting: str, skill: str, n_positive: int, n_negative: int, seed: int | None = None
    ) -> Examples:
        """See ``MemoryService.sample_examples``."""
        req = pb.SampleExamplesRequest(
            setting=wire.setting_number(setting), skill=skill, n_positive=n_positive, n_negative=n_negative
        )
        if seed is not None:
            req.seed = seed
        return wire.examples_from_pb(await self._call("", lambda: self._stub.SampleExamples(req, **self._kw)))

    async def set_window(self, env_id: str, window_start: int, window_versions: int) -> Environment:
        """See ``MemoryService.set_window`` (the returned record carries no code)."""
        req = pb.SetWindowRequest(env_id=env_id, window_start=window_start, window_versions=window_versions)
        res = await self._call(env_id, lambda: self._stub.SetWindow(req, **self._kw))
        return wire.env_from_pb(res)

    async def record_attempts(self, attempts: Sequence[DesignerAttempt]) -> RecordResult:
        """See ``MemoryService.record_attempts``."""
        req = pb.RecordAttemptsRequest(attempts=[wire.attempt_to_pb(a) for a in attempts])
        res = await self._call("", lambda: self._stub.RecordAttempts(req, **self._kw))
        return RecordResult(recorded=res.recorded, duplicates=res.duplicates)

    async def record_probe(self, probe: EnvProbe) -> None:
        """See ``MemoryService.record_probe``."""
        req = wire.probe_to_pb(probe)
        await self._call(probe.env_id, lambda: self._stub.RecordProbe(req, **self._kw))

    async def get_run_spec(self) -> RunSpecRecord:
        """See ``MemoryService.get_run_spec`` (raises ``RunSpecNotSet`` before one is stored)."""
        req = pb.GetRunSpecRequest()
        res = await self._call(
            "",
            lambda: self._stub.GetRunSpec(req, **self._kw),
            not_found=RunSpecNotSet,
        )
        return wire.runspec_from_pb(res)

    async def set_run_spec(self, spec: RunSpec, replace: bool = False) -> RunSpecRecord:
        """See ``MemoryService.set_run_spec`` (raises ``RunSpecConflict``)."""
        req = pb.SetRunSpecRequest(spec_json=spec.to_json(), replace=replace)
        res = await self._call("", lambda: self._stub.SetRunSpec(req, **self._kw))
        return wire.runspec_from_pb(res)

    async def close(self) -> None:
        """Close the channel."""
        await self._channel.close(None)
