"""The WorkQueue contract, run against the real Redis and the in-process queue alike."""

from __future__ import annotations

import asyncio

import pytest

from spade.queues import QueueFull
from tests.integration.queues.conftest import QueueMaker

S = "envs.ready"


async def drain(q, group: str, consumer: str, *, ack: bool = True) -> list[str]:
    keys = []
    while batch := await q.consume(S, group, consumer, count=10, block_ms=50):
        for d in batch:
            keys.append(d.key)
            if ack:
                await q.ack(S, group, d.message_id)
    return keys


async def test_roundtrip_ack_clears_pending(make: QueueMaker) -> None:
    q = make()
    mid = await q.publish(S, b"\x00payload\xff", key="k1")
    [d] = await q.consume(S, "g", "c1", count=5, block_ms=100)
    assert (d.stream, d.message_id, d.key, d.payload, d.deliveries) == (S, mid, "k1", b"\x00payload\xff", 1)
    assert await q.pending(S, "g") == 1
    await q.ack(S, "g", d.message_id)
    assert await q.pending(S, "g") == 0
    assert await q.consume(S, "g", "c1", block_ms=50) == []
    assert await q.length(S) == 0


async def test_messages_published_before_the_group_exists_are_delivered(make: QueueMaker) -> None:
    q = make()
    for i in range(3):
        await q.publish(S, b"x", key=f"k{i}")
    assert await drain(q, "late-group", "c") == ["k0", "k1", "k2"]


async def test_publish_is_idempotent_by_key(make: QueueMaker) -> None:
    q = make()
    first = await q.publish(S, b"one", key="same")
    again = await q.publish(S, b"two", key="same")
    assert first == again
    delivered = await q.consume(S, "g", "c", count=10, block_ms=50)
    assert [(d.key, d.payload) for d in delivered] == [("same", b"one")]
    # Still deduplicated after the first copy was consumed and acknowledged.
    await q.ack(S, "g", delivered[0].message_id)
    assert await q.publish(S, b"three", key="same") == first
    assert await q.consume(S, "g", "c", block_ms=50) == []


async def test_each_message_goes_to_one_consumer_of_a_group(make: QueueMaker) -> None:
    q = make()
    for i in range(20):
        await q.publish(S, b"x", key=f"k{i}")
    a = await q.consume(S, "g", "a", count=7, block_ms=50)
    b = await q.consume(S, "g", "b", count=100, block_ms=50)
    assert len(a) == 7 and len(b) == 13
    assert {d.key for d in a}.isdisjoint({d.key for d in b})


async def test_every_group_sees_every_message_and_it_is_freed_after_all_ack(make: QueueMaker) -> None:
    q = make()
    await q.consume(S, "learner", "c", block_ms=1)  # both groups exist before the publish
    await q.consume(S, "audit", "c", block_ms=1)
    await q.publish(S, b"x", key="k")
    assert await drain(q, "learner", "c") == ["k"]
    assert await q.length(S) == 1
    assert await drain(q, "audit", "c") == ["k"]
    assert await q.length(S) == 0


async def test_fresh_pending_message_is_not_redelivered(make: QueueMaker) -> None:
    q = make(claim_idle_ms=600_000)
    await q.publish(S, b"x", key="k")
    assert len(await q.consume(S, "g", "a", block_ms=50)) == 1
    assert await q.consume(S, "g", "b", block_ms=50) == []
    assert await q.pending(S, "g") == 1


async def test_consumer_dying_mid_message_is_redelivered_and_processed_once(make: QueueMaker) -> None:
    producer = make(claim_idle_ms=200)
    for i in range(5):
        await producer.publish(S, f"job{i}".encode(), key=f"k{i}")
    dying = make(claim_idle_ms=200)
    taken = await dying.consume(S, "workers", "doomed", count=2, block_ms=100)
    assert [d.key for d in taken] == ["k0", "k1"]
    if make.backend == "redis":  # type: ignore[attr-defined]
        await dying.close()  # the process is gone: its connections with it

    survivor = make(claim_idle_ms=200)
    processed: list[str] = []
    deliveries: dict[str, int] = {}
    while len(processed) < 5:
        for d in await survivor.consume(S, "workers", "survivor", count=10, block_ms=100):
            processed.append(d.key)
            deliveries[d.key] = d.deliveries
            await survivor.ack(S, "workers", d.message_id)
    await asyncio.sleep(0.3)  # past another idle window: nothing may come back
    assert await survivor.consume(S, "workers", "survivor", count=10, block_ms=50) == []
    assert sorted(processed) == [f"k{i}" for i in range(5)]
    assert deliveries["k0"] == deliveries["k1"] == 2
    assert all(deliveries[f"k{i}"] == 1 for i in range(2, 5))
    assert await survivor.pending(S, "workers") == 0


async def test_full_stream_fails_loudly_and_keeps_every_message(make: QueueMaker) -> None:
    q = make(max_len=3)
    for i in range(3):
        await q.publish(S, b"x", key=f"k{i}")
    with pytest.raises(QueueFull, match="max_len 3"):
        await q.publish(S, b"x", key="k3", timeout_s=0.2)
    assert await drain(q, "g", "c") == ["k0", "k1", "k2"]
    # The refused message was not stored under its key: publishing it now succeeds.
    await q.publish(S, b"x", key="k3", timeout_s=0.2)
    assert await drain(q, "g", "c") == ["k3"]


async def test_full_stream_blocks_the_producer_until_a_consumer_makes_room(make: QueueMaker) -> None:
    q = make(max_len=2)
    await q.publish(S, b"x", key="a")
    await q.publish(S, b"x", key="b")
    blocked = asyncio.create_task(q.publish(S, b"x", key="c", timeout_s=30))
    await asyncio.sleep(0.1)
    assert not blocked.done()
    [d] = await q.consume(S, "g", "c", block_ms=100)
    await q.ack(S, "g", d.message_id)
    await asyncio.wait_for(blocked, timeout=30)
    assert await drain(q, "g", "c") == ["b", "c"]


async def test_unacknowledged_messages_count_against_the_bound(make: QueueMaker) -> None:
    q = make(max_len=2)
    await q.publish(S, b"x", key="a")
    await q.publish(S, b"x", key="b")
    assert len(await q.consume(S, "g", "c", count=2, block_ms=50)) == 2  # read but not acked
    with pytest.raises(QueueFull):
        await q.publish(S, b"x", key="c", timeout_s=0.1)


async def test_consume_blocks_until_a_message_arrives(make: QueueMaker) -> None:
    q = make()
    waiting = asyncio.create_task(q.consume(S, "g", "c", block_ms=10_000))
    await asyncio.sleep(0.1)
    if make.backend == "redis":  # type: ignore[attr-defined]
        # The blocked reader holds its own connection; publish on another handle.
        q = make()
    await q.publish(S, b"late", key="late")
    got = await asyncio.wait_for(waiting, timeout=15)
    assert [d.key for d in got] == ["late"]


async def test_bad_arguments_are_rejected(make: QueueMaker) -> None:
    q = make()
    with pytest.raises(ValueError, match="idempotency key"):
        await q.publish(S, b"x", key="")
    with pytest.raises(ValueError, match="count"):
        await q.consume(S, "g", "c", count=0)


async def test_concurrent_producers_and_consumers_under_back_pressure_lose_nothing(make: QueueMaker) -> None:
    handles = [make(max_len=10, claim_idle_ms=600_000) for _ in range(3)]
    n_producers, per = 4, 50
    seen: list[str] = []
    finished = asyncio.Event()

    async def produce(p: int) -> None:
        for i in range(per):
            await handles[p % 3].publish(S, f"{p}:{i}".encode(), key=f"p{p}-{i}", timeout_s=60)

    async def consume(c: int) -> None:
        q = handles[c]
        while not finished.is_set():
            for d in await q.consume(S, "workers", f"c{c}", count=3, block_ms=50):
                seen.append(d.key)
                await q.ack(S, "workers", d.message_id)
            if len(seen) >= n_producers * per:
                finished.set()

    await asyncio.wait_for(
        asyncio.gather(*(produce(p) for p in range(n_producers)), *(consume(c) for c in range(3))), timeout=120
    )
    assert sorted(seen) == sorted(f"p{p}-{i}" for p in range(n_producers) for i in range(per))
    assert await handles[0].length(S) == 0
