"""The ``WorkQueue`` contract on Redis Streams (distributed mode).

Layout in Redis, for a stream ``s`` under prefix ``p`` (the hash tag keeps a stream's keys in one
cluster slot so the scripts below stay atomic):

- ``p{s}`` — the stream; each entry has fields ``k`` (idempotency key) and ``d`` (payload);
- ``p{s}:key:<key>`` — the id stored for a publish key, with a TTL (``idempotency_ttl_s``).

Guarantees and how they are kept:

- *Idempotent publish*: one Lua script checks each key, checks the bound, ``XADD``s and stores the
  key — atomically, so a retried publish (say after a dropped connection) never duplicates work. A
  batch (``publish_many``) is one script call per ``BATCH`` messages: one round trip, not one each.
- *Back-pressure*: an entry is deleted once every consumer group has acknowledged it (the ack script,
  which takes a batch of ids: ``ack_many``),
  so ``XLEN`` counts exactly the unread-or-unacknowledged messages. A publish that finds
  ``XLEN >= max_len`` waits with back-off up to its timeout, then raises ``QueueFull``. Nothing is
  trimmed, so nothing is dropped.
- *Re-delivery*: ``consume`` first ``XAUTOCLAIM``s entries pending longer than ``claim_idle_ms`` (their
  consumer died or hung), then reads new ones with ``XREADGROUP``. Groups are created at id ``0`` so
  messages published before the first consumer arrives are delivered too.
- *Dropped connections*: redis-py retries every command on a fresh connection with exponential
  back-off, under the queue's ``retry`` policy (``spade.retry.RetryPolicy.redis_retry``). A read
  whose reply was lost leaves its messages pending, and they are re-delivered after
  ``claim_idle_ms``; a publish is safe to retry because it is idempotent. Once the tries are spent
  the operation raises ``QueueError`` naming the server (without its password).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import redis.asyncio as aioredis
import tenacity
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from spade.queues.base import Delivery, QueueError, QueueFull
from spade.queues.config import RedisQueueConfig
from spade.redact import redact

T = TypeVar("T")

# One batch: KEYS = [stream, key record of message 1, ..., of message n]; ARGV = [max_len, ttl, k1, d1, ...].
# Answers a flat list, status then value per message handled, in order: {0, id} stored, {1, id} a known
# key, {2, xlen} the stream is full (then it stops: the rest of the batch waits for room, in order).
_PUBLISH_LUA = """
local out = {}
local n = redis.call('XLEN', KEYS[1])
local max_len = tonumber(ARGV[1])
local ttl = tonumber(ARGV[2])
for i = 2, #KEYS do
  local known = redis.call('GET', KEYS[i])
  if known then
    out[#out + 1] = 1
    out[#out + 1] = known
  else
    if n >= max_len then
      out[#out + 1] = 2
      out[#out + 1] = tostring(n)
      return out
    end
    local j = 3 + (i - 2) * 2
    local id = redis.call('XADD', KEYS[1], '*', 'k', ARGV[j], 'd', ARGV[j + 1])
    redis.call('SET', KEYS[i], id, 'EX', ttl)
    n = n + 1
    out[#out + 1] = 0
    out[#out + 1] = id
  end
end
return out
"""

# XACK each id of ARGV[2..] for group ARGV[1], then XDEL the entries no group still needs (every
# group has read past them and none holds them pending). Returns how many were acknowledged.
_ACK_LUA = """
local function parse(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  return tonumber(ms), tonumber(seq)
end
local groups = {}
for _, g in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
  local name, last
  for i = 1, #g, 2 do
    if g[i] == 'name' then name = g[i + 1] elseif g[i] == 'last-delivered-id' then last = g[i + 1] end
  end
  local lms, lseq = parse(last)
  groups[#groups + 1] = {name, lms, lseq}
end
local total = 0
for a = 2, #ARGV do
  local id = ARGV[a]
  local acked = redis.call('XACK', KEYS[1], ARGV[1], id)
  if acked > 0 then
    total = total + acked
    local ims, iseq = parse(id)
    local free = true
    for _, g in ipairs(groups) do
      if g[2] < ims or (g[2] == ims and g[3] < iseq) then free = false break end
      if #redis.call('XPENDING', KEYS[1], g[1], id, id, 1) > 0 then free = false break end
    end
    if free then redis.call('XDEL', KEYS[1], id) end
  end
end
return total
"""

BATCH = 256
"""Most messages one script call publishes or acknowledges (a script blocks Redis while it runs)."""


def stream_key(prefix: str, stream: str) -> str:
    """The Redis key of ``stream`` under ``prefix``, braces included (a hash tag).

    ``redis-cli`` needs it quoted, braces and all: ``redis-cli xlen 'spade:{samples.agent}'``.

    >>> stream_key("spade:", "samples.agent")
    'spade:{samples.agent}'
    """
    if not stream:
        raise ValueError("stream name must be non-empty")
    return f"{prefix}{{{stream}}}"


class RedisStreamQueue:
    """A ``WorkQueue`` on Redis Streams with consumer groups.

    Args:
        config: Connection, key prefix, bounds and timings (see ``RedisQueueConfig``).
        client: An existing asyncio Redis client to use instead of connecting to ``config.url``
            (its responses must not be decoded).
    """

    def __init__(self, config: RedisQueueConfig, client: aioredis.Redis | None = None) -> None:
        self._config = config
        self.client_name = f"spade-queue-{uuid.uuid4().hex[:12]}"
        self._redis: aioredis.Redis = client or aioredis.Redis.from_url(
            config.url,
            client_name=self.client_name,
            decode_responses=False,
            # Blocking reads are capped below this (see consume), so only a dead peer trips it.
            socket_timeout=config.socket_timeout_s,
            socket_keepalive=True,
            retry=config.retry.redis_retry(),
        )
        self._publish_script = self._redis.register_script(_PUBLISH_LUA)
        self._ack_script = self._redis.register_script(_ACK_LUA)
        self._groups: set[tuple[str, str]] = set()

    def _stream_key(self, stream: str) -> str:
        return stream_key(self._config.prefix, stream)

    async def _call(self, what: str, op: Callable[[], Awaitable[T]]) -> T:
        """Run one operation (redis-py retries it); a connection still failing becomes ``QueueError``."""
        try:
            return await op()
        except (RedisConnectionError, RedisTimeoutError) as exc:
            raise QueueError(
                f"{what} failed: Redis at {redact(self._config.url)} unreachable after "
                f"{self._config.retry.attempts} attempts ({exc}); check the server or raise retry.attempts"
            ) from exc

    async def publish(self, stream: str, payload: bytes, *, key: str, timeout_s: float | None = None) -> str:
        """Append a message unless ``key`` was already published to ``stream``; return its id.

        Raises:
            QueueFull: The stream stayed at ``max_len`` for ``timeout_s`` (default from config).
            QueueError: Redis stayed unreachable through every reconnect attempt.
            ValueError: Empty key or stream name.
        """
        (message_id,) = await self.publish_many(stream, [(key, payload)], timeout_s=timeout_s)
        return message_id

    async def publish_many(
        self, stream: str, messages: Sequence[tuple[str, bytes]], *, timeout_s: float | None = None
    ) -> list[str]:
        """Append ``(key, payload)`` messages in order, each unless its key was already published.

        One script call per :data:`BATCH` messages (one round trip, atomic per call). When the stream
        fills up midway, the rest waits for room in order, up to ``timeout_s`` in all.

        Returns:
            The message ids, in the order of ``messages`` (a known key's id for a repeated key).

        Raises:
            QueueFull: The stream stayed at ``max_len`` for ``timeout_s``; a leading part of the batch
                may be stored, and publishing the whole batch again is safe.
            QueueError: Redis stayed unreachable through every reconnect attempt.
            ValueError: An empty key or stream name.
        """
        if any(not key for key, _ in messages):
            raise ValueError("publish needs a non-empty idempotency key for every message")
        skey = self._stream_key(stream)
        timeout = self._config.publish_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        ids: list[str] = []
        for start in range(0, len(messages), BATCH):
            ids += await self._publish_chunk(stream, skey, messages[start : start + BATCH], deadline, timeout)
        return ids

    async def _publish_chunk(
        self, stream: str, skey: str, chunk: Sequence[tuple[str, bytes]], deadline: float, timeout: float
    ) -> list[str]:
        ids: list[str] = []
        full_at = [0]

        async def send() -> bool:
            """Publish what is left of the chunk; whether all of it is stored now."""
            rest = chunk[len(ids) :]
            keys = [skey, *(f"{skey}:key:{key}" for key, _ in rest)]
            args: list[bytes | str | int] = [self._config.max_len, self._config.idempotency_ttl_s]
            for key, payload in rest:
                args += [key, payload]
            reply: Any = await self._call(f"publish to {stream!r}", lambda: self._publish_script(keys=keys, args=args))
            for status, value in zip(reply[::2], reply[1::2], strict=True):
                if int(status) == 2:
                    full_at[0] = int(value)
                    return False
                ids.append(bytes(value).decode())
            return True

        if await send():  # the common case: room for all of it, no retryer to build
            return ids
        # A full stream is polled with back-off until room appears or the deadline has passed.
        room = tenacity.AsyncRetrying(
            stop=tenacity.stop_before_delay(max(0.0, deadline - time.monotonic())),
            wait=tenacity.wait_exponential(multiplier=0.005, max=0.25),
            retry=tenacity.retry_if_result(lambda stored: not stored),
            retry_error_callback=lambda state: False,
        )
        if not await room(send):
            raise QueueFull(
                f"stream {stream!r} holds {full_at[0]} unacknowledged messages (max_len "
                f"{self._config.max_len}) and stayed full for {timeout:.3g}s; consumers are not "
                "keeping up — add consumers, raise max_len or retry later"
            )
        return ids

    async def _ensure_group(self, skey: str, group: str) -> None:
        if (skey, group) in self._groups:
            return
        try:
            await self._redis.xgroup_create(skey, group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._groups.add((skey, group))

    async def consume(
        self, stream: str, group: str, consumer: str, *, count: int = 1, block_ms: int = 1000
    ) -> list[Delivery]:
        """Deliver up to ``count`` messages, stale pending ones (re-deliveries) first.

        Blocks up to ``block_ms`` for new messages when none is available; returns ``[]`` then.
        """
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        skey = self._stream_key(stream)
        # Returning early with nothing is within the contract; hanging on a dead socket is not.
        block = max(1, min(block_ms, int((self._config.socket_timeout_s - 1.0) * 1000)))

        async def claim() -> list[Delivery]:
            await self._ensure_group(skey, group)
            return await self._claim_stale(stream, skey, group, consumer, count)

        async def read() -> list[Delivery]:
            await self._ensure_group(skey, group)
            reply: Any = await self._redis.xreadgroup(group, consumer, {skey: ">"}, count=count, block=block)
            return [self._delivery(stream, mid, fields, 1) for _, entries in reply or [] for mid, fields in entries]

        try:
            return await self._call(f"consume from {stream!r}", claim) or await self._call(
                f"consume from {stream!r}", read
            )
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            # The stream or group was deleted under us (an operator or a test cleaning up): the group is
            # recreated on the next call, which then starts from the oldest message still held.
            self._groups.discard((skey, group))
            return []

    async def _claim_stale(self, stream: str, skey: str, group: str, consumer: str, count: int) -> list[Delivery]:
        claimed: list[tuple[bytes, dict[bytes, bytes]]] = []
        cursor: bytes | str = "0-0"
        while len(claimed) < count:
            reply: Any = await self._redis.xautoclaim(
                skey, group, consumer, self._config.claim_idle_ms, start_id=cursor, count=count - len(claimed)
            )
            cursor, entries = reply[0], reply[1]
            claimed.extend((mid, fields) for mid, fields in entries if fields)
            if cursor in (b"0-0", "0-0"):
                break
        if not claimed:
            return []
        async with self._redis.pipeline(transaction=False) as pipe:
            for mid, _ in claimed:
                pipe.xpending_range(skey, group, min=mid, max=mid, count=1)
            infos = await pipe.execute()
        return [
            self._delivery(stream, mid, fields, int(info[0]["times_delivered"]) if info else 2)
            for (mid, fields), info in zip(claimed, infos, strict=True)
        ]

    @staticmethod
    def _delivery(stream: str, mid: bytes, fields: dict[bytes, bytes], deliveries: int) -> Delivery:
        return Delivery(
            stream=stream,
            message_id=mid.decode() if isinstance(mid, bytes) else str(mid),
            key=fields[b"k"].decode(),
            payload=fields[b"d"],
            deliveries=deliveries,
        )

    async def ack(self, stream: str, group: str, message_id: str) -> None:
        """Acknowledge a delivered message; it is deleted once every group has acknowledged it."""
        await self.ack_many(stream, group, [message_id])

    async def ack_many(self, stream: str, group: str, message_ids: Sequence[str]) -> None:
        """Acknowledge delivered messages (one script call per :data:`BATCH`); each is freed once no group needs it."""
        skey = self._stream_key(stream)
        for start in range(0, len(message_ids), BATCH):
            await self._ack_chunk(stream, skey, [group, *message_ids[start : start + BATCH]])

    async def _ack_chunk(self, stream: str, skey: str, args: list[str]) -> None:
        await self._call(f"ack on {stream!r}", lambda: self._ack_script(keys=[skey], args=args))

    async def pending(self, stream: str, group: str) -> int:
        """Number of delivered but unacknowledged messages of ``group``."""
        skey = self._stream_key(stream)

        async def op() -> int:
            try:
                info = await self._redis.xpending(skey, group)
            except ResponseError as exc:
                if "NOGROUP" in str(exc):
                    return 0
                raise
            return int(info["pending"])

        return await self._call(f"pending on {stream!r}", op)

    async def length(self, stream: str) -> int:
        """Messages held by ``stream`` (unread by some group or unacknowledged)."""
        skey = self._stream_key(stream)
        return int(await self._call(f"length of {stream!r}", lambda: self._redis.xlen(skey)))

    async def delete_all(self) -> int:
        """Delete every key under this queue's prefix (tests and benchmarks); returns the count."""
        n = 0
        async for k in self._redis.scan_iter(match=f"{self._config.prefix}*", count=500):
            n += int(await self._redis.delete(k))
        return n

    async def close(self) -> None:
        """Close the connection pool."""
        await self._redis.aclose()
