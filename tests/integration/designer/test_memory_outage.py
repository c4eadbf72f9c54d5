"""A designer attempt finished while the memory is down is recorded once the memory is back.

The attempt's sample is already on ``samples.designer`` when the designer records it, so a record
dropped on the outage would leave the learner with a designer sample the memory never counts (what
the chaos test, ``tests/e2e/test_chaos.py``, checks across a memory kill and a Postgres restart).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from pathlib import Path

import pytest

from services.designer.adapters import MemoryServiceEnvironments
from services.designer.core.ports import AttemptSummary
from services.memory.grpc_server import grpc_service
from services.memory.service import MemoryService
from services.memory.store.sql import SqlStore, make_engine, migrate
from spade.memory.client import MemoryClient
from spade.memory.errors import MemoryUnavailable
from spade.retry import RetryPolicy
from spade.serving.grpc import grpc_server
from spade.serving.settings import ServerAddress

ATTEMPT = AttemptSummary("s-1", "game", "Optimization", "r0-x", 0, "malformed", "", "spec")
PATIENT = RetryPolicy(attempts=40, initial_s=0.05, max_s=0.5, jitter_s=0.0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_an_attempt_finished_while_the_memory_is_down_is_recorded_when_it_is_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'memory.db'}")
    migrate(engine)
    store = SqlStore(engine)
    port = _free_port()
    client = MemoryClient(f"127.0.0.1:{port}", timeout_s=5)
    memory = MemoryServiceEnvironments(client, record_retry=PATIENT)
    try:
        with caplog.at_level(logging.WARNING, logger="spade.designer"):
            recording = asyncio.create_task(memory.record_attempts([ATTEMPT]))
            while "recording 1 designer attempts in the memory failed" not in caplog.text:
                assert not recording.done(), recording  # it must wait for the memory, not give up
                await asyncio.sleep(0.01)
            async with grpc_server([grpc_service(MemoryService(store))], ServerAddress(port=port), service="memory"):
                await recording
        assert [a.sample_id for a in store.attempts()] == ["s-1"]
    finally:
        await client.close()
        engine.dispose()


async def test_without_a_retry_policy_an_outage_is_raised_at_once(tmp_path: Path) -> None:
    client = MemoryClient(f"127.0.0.1:{_free_port()}", timeout_s=5)
    try:
        with pytest.raises(MemoryUnavailable):
            await MemoryServiceEnvironments(client).record_attempts([ATTEMPT])
    finally:
        await client.close()
