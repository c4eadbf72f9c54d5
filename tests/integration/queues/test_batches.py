"""publish_many and ack_many: the WorkQueue contract for batches, on the real Redis and in-process alike."""

from __future__ import annotations

import asyncio

import pytest

from spade.queues import QueueFull, publish_protos
from spade.queues.redis_streams import BATCH
from spade.v1 import queues_pb2
from tests.integration.queues.conftest import QueueMaker
from tests.integration.queues.test_contract import drain

S = "envs.ready"


async def test_a_batch_is_stored_in_order_and_delivered_once(make: QueueMaker) -> None:
    q = make()
    n = BATCH * 2 + 17  # more than one script call on Redis
    ids = await q.publish_many(S, [(f"k{i}", f"p{i}".encode()) for i in range(n)])
    assert len(ids) == n == len(set(ids))
    delivered = []
    while batch := await q.consume(S, "g", "c", count=100, block_ms=50):
        delivered += batch
    assert [(d.key, d.payload, d.message_id) for d in delivered] == [
        (f"k{i}", f"p{i}".encode(), ids[i]) for i in range(n)
    ]


async def test_a_batch_is_idempotent_by_key_within_and_across_calls(make: QueueMaker) -> None:
    q = make()
    first = await q.publish(S, b"old", key="a")
    ids = await q.publish_many(S, [("a", b"new"), ("b", b"1"), ("b", b"2"), ("c", b"3")])
    assert ids[0] == first and ids[1] == ids[2] and len(set(ids)) == 3
    again = await q.publish_many(S, [("c", b"x"), ("b", b"y")])
    assert again == [ids[3], ids[1]]
    delivered = await q.consume(S, "g", "c", count=10, block_ms=50)
    assert [(d.key, d.payload) for d in delivered] == [("a", b"old"), ("b", b"1"), ("c", b"3")]


async def test_a_batch_meeting_a_full_stream_stores_a_prefix_and_a_retry_stores_the_rest_once(
    make: QueueMaker,
) -> None:
    q = make(max_len=3)
    batch = [(f"k{i}", b"x") for i in range(5)]
    with pytest.raises(QueueFull, match="max_len 3"):
        await q.publish_many(S, batch, timeout_s=0.2)
    assert await q.length(S) == 3
    assert await drain(q, "g", "c") == ["k0", "k1", "k2"]
    await q.publish_many(S, batch, timeout_s=5)  # the whole batch again: only the rest is new
    assert await drain(q, "g", "c") == ["k3", "k4"]


async def test_a_batch_waits_for_room_and_finishes_in_order(make: QueueMaker) -> None:
    q = make(max_len=2)
    blocked = asyncio.create_task(q.publish_many(S, [(f"k{i}", b"x") for i in range(6)], timeout_s=30))
    seen: list[str] = []
    while len(seen) < 6:
        for d in await q.consume(S, "g", "c", count=1, block_ms=100):
            seen.append(d.key)
            await q.ack(S, "g", d.message_id)
    await asyncio.wait_for(blocked, timeout=30)
    assert seen == [f"k{i}" for i in range(6)]


async def test_ack_many_clears_pending_and_frees_only_what_every_group_acknowledged(make: QueueMaker) -> None:
    q = make()
    await q.consume(S, "learner", "c", block_ms=1)  # both groups exist before the publish
    await q.consume(S, "audit", "c", block_ms=1)
    await q.publish_many(S, [(f"k{i}", b"x") for i in range(BATCH + 10)])
    learner = []
    while batch := await q.consume(S, "learner", "c", count=200, block_ms=50):
        learner += batch
    await q.ack_many(S, "learner", [d.message_id for d in learner[:-5]])
    assert await q.pending(S, "learner") == 5
    assert await q.length(S) == BATCH + 10  # the audit group has read none of them
    await q.ack_many(S, "learner", [d.message_id for d in learner])  # the acknowledged ones again: no-op
    assert await q.pending(S, "learner") == 0
    audit = await q.consume(S, "audit", "c", count=BATCH + 10, block_ms=50)
    await q.ack_many(S, "audit", [d.message_id for d in audit[:10]])
    assert await q.length(S) == BATCH
    await q.ack_many(S, "audit", [d.message_id for d in audit[10:]])
    assert await q.length(S) == 0
    await q.ack_many(S, "audit", [])


async def test_unacknowledged_part_of_a_batch_is_redelivered(make: QueueMaker) -> None:
    q = make(claim_idle_ms=200)
    await q.publish_many(S, [(f"k{i}", b"x") for i in range(6)])
    taken = await q.consume(S, "g", "dying", count=6, block_ms=50)
    await q.ack_many(S, "g", [d.message_id for d in taken[:4]])
    await asyncio.sleep(0.3)
    again = await q.consume(S, "g", "survivor", count=10, block_ms=50)
    assert [(d.key, d.deliveries) for d in again] == [("k4", 2), ("k5", 2)]


async def test_publish_protos_checks_the_type_and_publishes_in_one_batch(make: QueueMaker) -> None:
    q = make()
    ready = [(f"e{i}", queues_pb2.EnvReady(env_id=f"e{i}")) for i in range(3)]
    ids = await publish_protos(q, S, ready)
    assert len(ids) == 3
    with pytest.raises(TypeError, match=r"carries spade\.v1\.EnvReady"):
        await publish_protos(q, S, [("x", queues_pb2.AgentSample())])
    assert [d.key for d in await q.consume(S, "g", "c", count=10, block_ms=50)] == ["e0", "e1", "e2"]


async def test_empty_keys_in_a_batch_are_refused_before_anything_is_stored(make: QueueMaker) -> None:
    q = make()
    with pytest.raises(ValueError, match="idempotency key"):
        await q.publish_many(S, [("a", b"x"), ("", b"y")])
    assert await q.length(S) == 0
