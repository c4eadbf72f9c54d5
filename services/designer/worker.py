"""The designer's worker, its long-running loop (``spade serve designer``): a batch at start, then one
per ``k`` versions.

The designer follows the learner through ``weights.published``: each published version is counted,
and when the policy has advanced ``regenerate_every`` versions since the last batch a new batch is
designed with the new weights. Messages are acknowledged after the decision is taken, so a
restarted designer re-reads what it had not handled.
"""

from __future__ import annotations

import asyncio
import logging

from services.designer.core.loop import BatchResult, Designer
from spade.queues.base import WEIGHTS_PUBLISHED, WorkQueue
from spade.v1 import queues_pb2

log = logging.getLogger(__name__)

CONSUMER_GROUP = "designer"


async def serve_forever(
    designer: Designer,
    queue: WorkQueue,
    *,
    regenerate_every: int,
    stop: asyncio.Event,
    consumer: str = "designer-0",
    initial_version: int = 0,
) -> list[tuple[int, BatchResult]]:
    """Design a batch now, then after every ``regenerate_every`` published versions, until ``stop``.

    Several versions published while a batch runs count once: the next batch uses the newest
    weights rather than running one batch per missed window.

    Returns:
        ``(weight version seen, batch)`` for every batch run (for logs and tests).
    """
    if regenerate_every < 1:
        raise ValueError(f"regenerate_every must be >= 1, got {regenerate_every}")
    last_version = initial_version
    results = [(last_version, await designer.run_batch())]
    while not stop.is_set():
        deliveries = await queue.consume(WEIGHTS_PUBLISHED, CONSUMER_GROUP, consumer, count=16, block_ms=500)
        newest = last_version
        for delivery in deliveries:
            message = queues_pb2.WeightsPublished.FromString(delivery.payload)
            newest = max(newest, int(message.weight_version))
        if newest - last_version >= regenerate_every:
            log.info("weights v%d published: designing a new batch", newest)
            results.append((newest, await designer.run_batch()))
            last_version = newest
        for delivery in deliveries:
            await queue.ack(WEIGHTS_PUBLISHED, CONSUMER_GROUP, delivery.message_id)
    return results
