"""The queue factory: a config in, the queue it describes out.

Apart from the configs (``spade.queues.config``), so that the configs import neither backend and no
backend's import runs back through the configs: the factory sits above all three.
"""

from __future__ import annotations

from collections.abc import Callable

from spade.queues.base import WorkQueue
from spade.queues.config import InProcessQueueConfig, RedisQueueConfig


def _make_redis(config: RedisQueueConfig | InProcessQueueConfig) -> WorkQueue:
    from spade.queues.redis_streams import RedisStreamQueue

    assert isinstance(config, RedisQueueConfig)
    return RedisStreamQueue(config)


def _make_inprocess(config: RedisQueueConfig | InProcessQueueConfig) -> WorkQueue:
    from spade.queues.inprocess import InProcessQueue

    assert isinstance(config, InProcessQueueConfig)
    return InProcessQueue(config)


_REGISTRY: dict[str, Callable[[RedisQueueConfig | InProcessQueueConfig], WorkQueue]] = {
    "redis": _make_redis,
    "inprocess": _make_inprocess,
}


def make_queue(config: RedisQueueConfig | InProcessQueueConfig) -> WorkQueue:
    """Build the queue a config describes.

    Args:
        config: A ``RedisQueueConfig`` or ``InProcessQueueConfig`` (validate raw data with
            ``QueueConfigAdapter`` first).

    Returns:
        A ``WorkQueue``; close it with ``await queue.close()``.
    """
    return _REGISTRY[config.kind](config)
