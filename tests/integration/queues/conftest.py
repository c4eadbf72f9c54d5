"""Queue fixtures: every contract test runs against the real Redis and the in-process queue."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from spade.queues import InProcessQueueConfig, RedisQueueConfig, WorkQueue, make_queue
from spade.queues.redis_streams import RedisStreamQueue
from tests.conftest import REDIS_URL

QueueMaker = Callable[..., WorkQueue]


@pytest.fixture(params=[pytest.param("redis", marks=pytest.mark.redis), "inprocess"])
async def make(request: pytest.FixtureRequest) -> AsyncIterator[QueueMaker]:
    """Build queues of one backend that share state (one Redis prefix, or one in-process queue).

    ``make(**overrides)`` returns a new handle; for Redis each handle has its own connections, so
    closing one is a consumer process dying. Keys are removed afterwards.
    """
    prefix = f"test:{uuid.uuid4().hex}:"
    made: list[WorkQueue] = []
    shared: dict[str, WorkQueue] = {}

    def factory(**overrides: Any) -> WorkQueue:
        if request.param == "redis":
            q = make_queue(RedisQueueConfig(url=REDIS_URL, prefix=prefix, **overrides))
        else:
            # One process: handles are the same queue object (its state is the "server").
            if "q" not in shared:
                shared["q"] = make_queue(InProcessQueueConfig(**overrides))
            q = shared["q"]
        made.append(q)
        return q

    factory.backend = request.param  # type: ignore[attr-defined]
    yield factory
    if request.param == "redis":
        cleaner = RedisStreamQueue(RedisQueueConfig(url=REDIS_URL, prefix=prefix))
        await cleaner.delete_all()
        await cleaner.close()
    for q in made:
        await q.close()
