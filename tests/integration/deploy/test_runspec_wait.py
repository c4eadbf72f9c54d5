"""A service waiting for the run spec keeps waiting while the memory cannot be reached yet.

In a deployment the designer, rollout and learner start beside the memory (compose, Kubernetes): the
memory may not listen yet, or its name may not resolve yet. The first compose run crashed the rollout
there ("errors resolving memory:50052 ... DNS query cancelled" -> MemoryServiceError). The wait must
span that, over the real gRPC client and server, and still give up after its timeout with a reason.
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest

from services.memory.grpc_server import grpc_service
from services.memory.service import MemoryService
from services.memory.store.sql import SqlStore, make_engine, migrate
from spade.auth import KeyRing, Principal, Role, hash_key
from spade.memory.client import MemoryClient
from spade.memory.runspec import fetch_run_spec
from spade.runspec import RunSpec
from spade.serving.grpc import grpc_server
from spade.serving.settings import ServerAddress

KEY = "runspec-wait-key"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_the_wait_spans_a_memory_that_starts_later(tmp_path: Path) -> None:
    port = _free_port()
    client = MemoryClient(f"127.0.0.1:{port}", timeout_s=2, api_key=KEY)
    waiting = asyncio.create_task(fetch_run_spec(client, service="rollout", poll_s=0.1))
    try:
        await asyncio.sleep(1.0)  # several refused connections (UNAVAILABLE) meanwhile
        assert not waiting.done(), f"gave up while the memory was not listening yet: {waiting}"

        engine = make_engine(f"sqlite:///{tmp_path / 'memory.db'}")
        migrate(engine)
        service = MemoryService(SqlStore(engine))
        spec = RunSpec(group_size=6)
        await service.set_run_spec(spec)
        keys = KeyRing({hash_key(KEY): Principal("rollout", Role.WRITE)})
        async with grpc_server(
            [grpc_service(service)], ServerAddress(port=port), service="memory", authenticate=keys.authenticate
        ):
            assert await asyncio.wait_for(waiting, 60) == spec
        engine.dispose()
    finally:
        waiting.cancel()
        await client.close()


async def test_an_unresolvable_memory_is_waited_for_then_named_in_the_timeout() -> None:
    client = MemoryClient("memory.invalid:50052", timeout_s=2, api_key=KEY)
    try:
        with pytest.raises(TimeoutError, match="the memory was not reachable within 1 s"):
            await fetch_run_spec(client, service="designer", poll_s=0.1, timeout_s=1.0)
    finally:
        await client.close()
