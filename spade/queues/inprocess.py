"""The in-process work queue: the ``WorkQueue`` contract on asyncio, for embedded mode.

It mirrors the Redis Streams semantics exactly so the same contract tests run against both:
consumer groups that start at the oldest retained message, explicit ack, re-delivery of pending
messages idle for ``claim_idle_ms``, idempotent publish by key, and a ``max_len`` bound on messages
not yet acknowledged by every group (publish waits, then raises ``QueueFull``). A message is dropped
from memory once every group has acknowledged it.

All methods must run on one event loop (the process's); the queue is not thread-safe.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from spade.queues.base import Delivery, QueueError, QueueFull
from spade.queues.config import InProcessQueueConfig


@dataclass
class _Pending:
    consumer: str
    delivered_at: float
    deliveries: int


@dataclass
class _Group:
    last_delivered: int = 0
    pending: dict[int, _Pending] = field(default_factory=dict)


@dataclass
class _Stream:
    entries: dict[int, tuple[str, bytes]] = field(default_factory=dict)
    next_seq: int = 1
    keys: dict[str, tuple[int, float]] = field(default_factory=dict)
    groups: dict[str, _Group] = field(default_factory=dict)


def _message_id(seq: int) -> str:
    return f"{seq}-0"


def _parse_id(message_id: str) -> int:
    try:
        seq, _, _ = message_id.partition("-")
        return int(seq)
    except ValueError:
        raise QueueError(f"message id {message_id!r} is not an id this queue issued (expected '<n>-0')") from None


class InProcessQueue:
    """A ``WorkQueue`` held in this process's memory.

    Args:
        config: Bounds and timings (see ``InProcessQueueConfig``).
    """

    def __init__(self, config: InProcessQueueConfig | None = None) -> None:
        self._config = config or InProcessQueueConfig()
        self._streams: dict[str, _Stream] = {}
        self._changed = asyncio.Condition()
        self._closed = False

    def _stream(self, name: str) -> _Stream:
        if not name:
            raise ValueError("stream name must be non-empty")
        return self._streams.setdefault(name, _Stream())

    def _check_open(self) -> None:
        if self._closed:
            raise QueueError("the queue is closed; build a new one with make_queue()")

    async def publish(self, stream: str, payload: bytes, *, key: str, timeout_s: float | None = None) -> str:
        """Append a message unless ``key`` was already published to ``stream``; return its id.

        Raises:
            QueueFull: The stream stayed at ``max_len`` for ``timeout_s`` (default from config).
            ValueError: Empty key or stream name.
        """
        (message_id,) = await self.publish_many(stream, [(key, payload)], timeout_s=timeout_s)
        return message_id

    async def publish_many(
        self, stream: str, messages: Sequence[tuple[str, bytes]], *, timeout_s: float | None = None
    ) -> list[str]:
        """Append ``(key, payload)`` messages in order, each unless its key was already published.

        When the stream fills up midway the rest waits for room, in order, up to ``timeout_s`` in all.

        Raises:
            QueueFull: The stream stayed at ``max_len`` for ``timeout_s``; a leading part of the batch
                may be stored, and publishing the whole batch again is safe.
            ValueError: An empty key or stream name.
        """
        self._check_open()
        if any(not key for key, _ in messages):
            raise ValueError("publish needs a non-empty idempotency key for every message")
        timeout = self._config.publish_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        ids: list[str] = []
        async with self._changed:
            while len(ids) < len(messages):
                s = self._stream(stream)
                now = time.monotonic()
                if len(s.keys) > 4 * self._config.max_len:
                    s.keys = {k: v for k, v in s.keys.items() if v[1] > now}
                key, payload = messages[len(ids)]
                known = s.keys.get(key)
                if known is not None and known[1] > now:
                    ids.append(_message_id(known[0]))
                    continue
                if len(s.entries) < self._config.max_len:
                    seq = s.next_seq
                    s.next_seq += 1
                    s.entries[seq] = (key, bytes(payload))
                    s.keys[key] = (seq, now + self._config.idempotency_ttl_s)
                    ids.append(_message_id(seq))
                    self._changed.notify_all()
                    continue
                remaining = deadline - now
                if remaining <= 0:
                    raise QueueFull(
                        f"stream {stream!r} holds {len(s.entries)} unacknowledged messages (max_len "
                        f"{self._config.max_len}) and stayed full for {timeout:.3g}s; consumers are not "
                        "keeping up — add consumers, raise max_len or retry later"
                    )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), timeout=remaining)
        return ids

    async def consume(
        self, stream: str, group: str, consumer: str, *, count: int = 1, block_ms: int = 1000
    ) -> list[Delivery]:
        """Deliver up to ``count`` messages, stale pending ones (re-deliveries) first.

        Waits up to ``block_ms`` for a message when none is available; returns ``[]`` then.
        """
        self._check_open()
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        deadline = time.monotonic() + block_ms / 1000
        async with self._changed:
            while True:
                out = self._take(stream, group, consumer, count)
                if out:
                    return out
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return []
                # Wake up for new messages, and in time for the oldest pending one to turn stale.
                wait = min(remaining, self._next_stale_in(stream, group))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), timeout=max(wait, 0.001))

    def _next_stale_in(self, stream: str, group: str) -> float:
        g = self._stream(stream).groups.get(group)
        if g is None or not g.pending:
            return float("inf")
        oldest = min(p.delivered_at for p in g.pending.values())
        return oldest + self._config.claim_idle_ms / 1000 - time.monotonic()

    def _take(self, stream: str, group: str, consumer: str, count: int) -> list[Delivery]:
        s = self._stream(stream)
        g = s.groups.setdefault(group, _Group(last_delivered=0))
        now = time.monotonic()
        idle_s = self._config.claim_idle_ms / 1000
        out: list[Delivery] = []
        for seq, p in sorted(g.pending.items()):
            if len(out) >= count:
                break
            if now - p.delivered_at >= idle_s and seq in s.entries:
                p.consumer, p.delivered_at, p.deliveries = consumer, now, p.deliveries + 1
                key, payload = s.entries[seq]
                out.append(Delivery(stream, _message_id(seq), key, payload, p.deliveries))
        for seq in sorted(s.entries):
            if len(out) >= count:
                break
            if seq <= g.last_delivered:
                continue
            g.last_delivered = seq
            g.pending[seq] = _Pending(consumer, now, 1)
            key, payload = s.entries[seq]
            out.append(Delivery(stream, _message_id(seq), key, payload, 1))
        return out

    async def ack(self, stream: str, group: str, message_id: str) -> None:
        """Acknowledge a delivered message; it is freed once every group has acknowledged it."""
        await self.ack_many(stream, group, [message_id])

    async def ack_many(self, stream: str, group: str, message_ids: Sequence[str]) -> None:
        """Acknowledge delivered messages; each is freed once every group has acknowledged it."""
        self._check_open()
        seqs = [_parse_id(message_id) for message_id in message_ids]
        async with self._changed:
            s = self._stream(stream)
            g = s.groups.get(group)
            if g is None:
                return
            freed = False
            for seq in seqs:
                if g.pending.pop(seq, None) is None:
                    continue
                if all(other.last_delivered >= seq and seq not in other.pending for other in s.groups.values()):
                    freed = s.entries.pop(seq, None) is not None or freed
            if freed:
                self._changed.notify_all()

    async def pending(self, stream: str, group: str) -> int:
        """Number of delivered but unacknowledged messages of ``group``."""
        g = self._stream(stream).groups.get(group)
        return 0 if g is None else len(g.pending)

    async def length(self, stream: str) -> int:
        """Messages held by ``stream`` (unread by some group or unacknowledged)."""
        return len(self._stream(stream).entries)

    async def close(self) -> None:
        """Refuse further calls; messages still held are discarded with the process."""
        self._closed = True
