"""The designer's worker, its long-running loop (``spade serve designer``): a round at start, then one
per ``regenerate_every`` published versions, until SIGTERM.

The designer follows the learner through ``weights.published``: each published version is counted,
and when the policy has advanced ``regenerate_every`` versions since the last round a new round is
designed with the new weights. Messages are acknowledged after the decision is taken, so a
restarted designer re-reads what it had not handled.

Rounds are numbered from the version served at start (``initial_version // regenerate_every``),
then one by one, so a restarted designer continues the skill rotation roughly where it left it.

SIGTERM (``stop``) ends a running round at once: unfinished slots are cancelled, answers already
generated are finished within the round's grace, and the loop returns. A pool designer whose pool
is spent stays up (following the weights) but designs nothing more, and says so once.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from services.designer.core.rounds import BatchResult
from spade.queues.base import WEIGHTS_PUBLISHED, WorkQueue
from spade.serving import lifecycle
from spade.serving.logs import get_logger
from spade.v1 import queues_pb2

log = get_logger(__name__)

CONSUMER_GROUP = "designer"


class RoundDesigner(Protocol):
    """A designer that runs rounds: the policy's (``core.loop.Designer``) or the pool's."""

    async def run_batch(
        self, *, round_index: int | None = None, stop: asyncio.Event | None = None, weight_version: int = 0
    ) -> BatchResult: ...


def _exhausted(designer: RoundDesigner) -> bool:
    return bool(getattr(designer, "exhausted", False))


async def serve_forever(
    designer: RoundDesigner,
    queue: WorkQueue,
    *,
    regenerate_every: int,
    stop: asyncio.Event,
    consumer: str = "designer-0",
    initial_version: int = 0,
) -> list[tuple[int, BatchResult]]:
    """Design a round now, then after every ``regenerate_every`` published versions, until ``stop``.

    Several versions published while a round runs count once: the next round uses the newest
    weights rather than running one round per missed window.

    Returns:
        ``(weight version seen, round)`` for every round run (for logs and tests).
    """
    if regenerate_every < 1:
        raise ValueError(f"regenerate_every must be >= 1, got {regenerate_every}")
    last_version = initial_version
    round_index = initial_version // regenerate_every
    results: list[tuple[int, BatchResult]] = []
    said_spent = False

    async def design(version: int) -> None:
        nonlocal round_index, said_spent
        if _exhausted(designer):
            if not said_spent:
                log.warning("the designer pool is spent: no more rounds (following the weights until stopped)")
                said_spent = True
            return
        result = await designer.run_batch(round_index=round_index, stop=stop, weight_version=version)
        round_index += 1
        results.append((version, result))

    await design(last_version)
    while not stop.is_set():
        deliveries = await queue.consume(WEIGHTS_PUBLISHED, CONSUMER_GROUP, consumer, count=16, block_ms=500)
        newest = last_version
        for delivery in deliveries:
            message = queues_pb2.WeightsPublished.FromString(delivery.payload)
            newest = max(newest, int(message.weight_version))
        if newest - last_version >= regenerate_every and not stop.is_set():
            log.info("weights v%d published: designing round %d", newest, round_index)
            await design(newest)
            last_version = newest
        for delivery in deliveries:
            await queue.ack(WEIGHTS_PUBLISHED, CONSUMER_GROUP, delivery.message_id)
    lifecycle.note_finished(f"designer stopped after {len(results)} rounds", rounds=len(results))
    return results
