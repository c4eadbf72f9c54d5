"""``MemoryClient``: the ``MemoryService`` API over gRPC, for services in distributed mode.

It returns the same records as ``MemoryService`` and raises the same domain errors
(``EnvironmentNotFound``, ``InvalidArgument``) for NOT_FOUND and INVALID_ARGUMENT, so callers do not
care which one they hold.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import grpc

from spade.grpc_channels import client_options
from spade.memory import wire
from spade.memory.errors import EnvironmentNotFound, InvalidArgument, MemoryServiceError
from spade.memory.records import (
    EnvFilter,
    Environment,
    Examples,
    NewEnvironment,
    Page,
    Play,
    PutResult,
    RecordResult,
    StatsUpdate,
)
from spade.memory.wire import GRPC_OPTIONS
from spade.v1 import memory_pb2 as pb
from spade.v1 import memory_pb2_grpc as pb_grpc

T = TypeVar("T")


class MemoryClient:
    """Async client of ``spade.v1.Memory``.

    Args:
        target: ``host:port`` of the memory's gRPC server.
        timeout_s: Deadline of each call.
    """

    def __init__(self, target: str, timeout_s: float = 30.0) -> None:
        self._channel = grpc.aio.insecure_channel(target, options=client_options(*GRPC_OPTIONS))
        self._stub = pb_grpc.MemoryStub(self._channel)
        self._timeout = timeout_s

    async def _call(self, env_id: str, fn: Callable[[], Awaitable[T]]) -> T:
        try:
            return await fn()
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                raise EnvironmentNotFound(env_id) from None
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidArgument(exc.details() or "invalid argument") from None
            raise MemoryServiceError(f"memory RPC failed: {exc.code().name}: {exc.details()}") from exc

    async def put_environment(self, env: NewEnvironment) -> PutResult:
        """See ``MemoryService.put_environment``."""
        req = pb.PutEnvironmentRequest(environment=wire.new_env_to_pb(env))
        res = await self._call("", lambda: self._stub.PutEnvironment(req, timeout=self._timeout))
        return PutResult(env_id=res.env_id, duplicate_of=res.duplicate_of or None)

    async def get_environment(self, env_id: str) -> Environment:
        """See ``MemoryService.get_environment``."""
        req = pb.GetEnvironmentRequest(env_id=env_id)
        return wire.env_from_pb(await self._call(env_id, lambda: self._stub.GetEnvironment(req, timeout=self._timeout)))

    async def list_environments(
        self, f: EnvFilter | None = None, limit: int = 50, cursor: str | None = None, *, include_code: bool = True
    ) -> Page:
        """See ``MemoryService.list_environments`` (``seq`` of returned records is 0)."""
        req = wire.filter_to_pb(f or EnvFilter())
        req.limit, req.cursor, req.include_code = limit, cursor or "", include_code
        res = await self._call("", lambda: self._stub.ListEnvironments(req, timeout=self._timeout))
        return Page(items=tuple(wire.env_from_pb(e) for e in res.environments), next_cursor=res.next_cursor or None)

    async def record_plays(self, plays: Sequence[Play]) -> RecordResult:
        """See ``MemoryService.record_plays``."""
        req = pb.RecordPlaysRequest(plays=[wire.play_to_pb(p) for p in plays])
        missing = next(iter(sorted({p.env_id for p in plays})), "")
        res = await self._call(missing, lambda: self._stub.RecordPlays(req, timeout=self._timeout))
        return RecordResult(recorded=res.recorded, duplicates=res.duplicates)

    async def update_stats(self, env_id: str, update: StatsUpdate) -> Environment:
        """See ``MemoryService.update_stats``."""
        req = wire.update_to_pb(env_id, update)
        return wire.env_from_pb(await self._call(env_id, lambda: self._stub.UpdateStats(req, timeout=self._timeout)))

    async def sample_examples(
        self, setting: str, skill: str, n_positive: int, n_negative: int, seed: int | None = None
    ) -> Examples:
        """See ``MemoryService.sample_examples``."""
        req = pb.SampleExamplesRequest(setting=setting, skill=skill, n_positive=n_positive, n_negative=n_negative)
        if seed is not None:
            req.seed = seed
        return wire.examples_from_pb(
            await self._call("", lambda: self._stub.SampleExamples(req, timeout=self._timeout))
        )

    async def close(self) -> None:
        """Close the channel."""
        await self._channel.close(None)
