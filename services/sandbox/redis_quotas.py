"""Quotas counted in Redis, so that every replica of the sandbox shares each tenant's quota.

- Concurrent sessions: one sorted set per tenant, a member per session scored by the end of its
  lease. The replica holding a session renews the lease (the service's reap loop); a replica that
  dies stops renewing, and its sessions stop counting once their lease runs out.
- Runs per minute: one sorted set per tenant, a member per run scored by when it happened; runs older
  than the window are dropped on every charge.

Each check-and-count is one Lua script, so two replicas cannot both take the last slot; times are
the Redis server's (``TIME``), so replicas' clocks need not agree. When Redis cannot be reached the
store refuses (``ServiceUnavailable``): quotas fail closed.
"""

from __future__ import annotations

import contextlib
import uuid
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from services.sandbox.core.auth import Tenant
from services.sandbox.core.errors import ServiceUnavailable
from services.sandbox.core.quotas import WINDOW_S, runs_exceeded, sessions_exceeded
from services.sandbox.settings import RedisQuotaSettings

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

_ACQUIRE = (
    _NOW
    + """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local lease = tonumber(ARGV[3])
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  local held = redis.call('ZCARD', KEYS[1])
  if held >= tonumber(ARGV[2]) then return held end
end
redis.call('ZADD', KEYS[1], now + lease, ARGV[1])
redis.call('PEXPIRE', KEYS[1], 2 * lease)
return -1
"""
)
"""KEYS: the tenant's sessions. ARGV: session id, max sessions, lease (ms). -1: held; else the count held."""

_RENEW = (
    _NOW
    + """
local lease = tonumber(ARGV[1])
for i = 2, #ARGV do
  redis.call('ZADD', KEYS[1], 'XX', now + lease, ARGV[i])
end
redis.call('PEXPIRE', KEYS[1], 2 * lease)
return 0
"""
)
"""KEYS: the tenant's sessions. ARGV: lease (ms), then the ids this replica still holds."""

_CHARGE = (
    _NOW
    + """
local window = tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[1]) then
  local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  return math.max(1, tonumber(oldest[2]) + window - now)
end
redis.call('ZADD', KEYS[1], now, ARGV[3])
redis.call('PEXPIRE', KEYS[1], window)
return -1
"""
)
"""KEYS: the tenant's runs. ARGV: runs per window, window (ms), a unique member. -1: counted; else ms to wait."""


class RedisQuotas:
    """A ``QuotaStore`` in Redis (see the module docstring).

    Args:
        settings: Where Redis is, the key prefix, the session lease and the retry policy.
        client: An existing asyncio client to use instead of connecting to ``settings.url``.
    """

    def __init__(self, settings: RedisQuotaSettings, client: aioredis.Redis | None = None) -> None:
        self.settings = settings
        self._owned = client is None
        self._redis: aioredis.Redis = client or aioredis.Redis.from_url(
            settings.url,
            socket_timeout=settings.socket_timeout_s,
            socket_connect_timeout=settings.socket_timeout_s,
            retry=settings.retry.redis_retry(),
        )
        self._acquire = self._redis.register_script(_ACQUIRE)
        self._renew = self._redis.register_script(_RENEW)
        self._charge = self._redis.register_script(_CHARGE)
        self._lease_ms = int(settings.lease_s * 1000)

    def _key(self, what: str, tenant: str) -> str:
        return f"{self.settings.prefix}:{what}:{tenant}"

    async def _run(self, script: Any, keys: list[str], args: list[Any]) -> int:
        try:
            return int(await script(keys=keys, args=args))
        except (RedisConnectionError, RedisTimeoutError) as exc:
            raise ServiceUnavailable(
                f"the sandbox's quota store (Redis, {self.settings.retry.attempts} tries) is unreachable ({exc}): "
                "retry shortly; the operator should check SPADE_SANDBOX_QUOTAS__URL"
            ) from None

    async def acquire_session(self, tenant: Tenant, session_id: str) -> None:
        held = await self._run(
            self._acquire, [self._key("sessions", tenant.name)], [session_id, tenant.max_sessions, self._lease_ms]
        )
        if held >= 0:
            raise sessions_exceeded(tenant, held)

    async def release_session(self, tenant: Tenant, session_id: str) -> None:
        with contextlib.suppress(RedisConnectionError, RedisTimeoutError):  # else its lease runs out on its own
            await self._redis.zrem(self._key("sessions", tenant.name), session_id)

    async def renew_sessions(self, held: Mapping[str, Tenant]) -> None:
        by_tenant: dict[str, list[str]] = defaultdict(list)
        for session_id, tenant in held.items():
            by_tenant[tenant.name].append(session_id)
        for name, ids in by_tenant.items():
            await self._run(self._renew, [self._key("sessions", name)], [self._lease_ms, *ids])

    async def charge_run(self, tenant: Tenant) -> None:
        wait_ms = await self._run(
            self._charge,
            [self._key("runs", tenant.name)],
            [tenant.executions_per_minute, int(WINDOW_S * 1000), uuid.uuid4().hex],
        )
        if wait_ms >= 0:
            raise runs_exceeded(tenant, wait_ms / 1000)

    async def close(self) -> None:
        if self._owned:
            await self._redis.aclose()
