"""Per-tenant quotas: concurrent sessions, and runs (executions, validations, session opens) per minute.

``QuotaStore`` is what the service asks; ``LocalQuotas`` answers for one replica (dev mode, a single
replica) and ``services.sandbox.redis_quotas.RedisQuotas`` for every replica together. Both refuse
with ``QuotaExceeded`` naming the limit and when to retry (``retry_after_s``, sent as the HTTP
``Retry-After`` header and gRPC ``retry-after`` trailer).

Sessions are held by id: releasing one twice, or one never acquired, changes nothing, so a session
that ended on its own (a finished episode, a failed load) and is later closed is counted once.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict, deque
from collections.abc import Callable, Mapping
from typing import Protocol

from services.sandbox.core.auth import Tenant
from services.sandbox.core.errors import QuotaExceeded

WINDOW_S = 60.0
"""The run rate is counted over a rolling window of this many seconds."""


def sessions_exceeded(tenant: Tenant, held: int) -> QuotaExceeded:
    """The refusal of a session over the tenant's concurrent-session quota."""
    return QuotaExceeded(
        f"tenant {tenant.name!r} already holds {held} open sessions, its limit is {tenant.max_sessions}: "
        "close sessions you no longer need (finished ones are released at once)",
        retry_after_s=1.0,
    )


def runs_exceeded(tenant: Tenant, retry_in_s: float) -> QuotaExceeded:
    """The refusal of a run over the tenant's per-minute rate."""
    return QuotaExceeded(
        f"tenant {tenant.name!r} reached {tenant.executions_per_minute} runs (executions, validations and "
        f"session opens) per minute: retry in {math.ceil(retry_in_s)} s",
        retry_after_s=max(retry_in_s, 0.001),
    )


class QuotaStore(Protocol):
    """Where quotas are counted."""

    async def acquire_session(self, tenant: Tenant, session_id: str) -> None:
        """Count session ``session_id`` against ``tenant``'s concurrent sessions.

        Raises:
            QuotaExceeded: The tenant already holds its maximum.
        """
        ...

    async def release_session(self, tenant: Tenant, session_id: str) -> None:
        """Stop counting ``session_id`` (idempotent)."""
        ...

    async def renew_sessions(self, held: Mapping[str, Tenant]) -> None:
        """Say that this replica still holds these sessions (a store with leases extends them)."""
        ...

    async def charge_run(self, tenant: Tenant) -> None:
        """Count one run against ``tenant``'s per-minute rate.

        Raises:
            QuotaExceeded: The tenant reached its rate; ``retry_after_s`` says when one run is free.
        """
        ...

    async def close(self) -> None:
        """Release what the store holds (connections)."""
        ...


class LocalQuotas:
    """Quotas of this replica only (with N replicas, a tenant gets N times its quota).

    Args:
        clock: Monotonic clock in seconds (injectable for tests).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._sessions: dict[str, set[str]] = defaultdict(set)
        self._runs: dict[str, deque[float]] = defaultdict(deque)

    async def acquire_session(self, tenant: Tenant, session_id: str) -> None:
        held = self._sessions[tenant.name]
        if session_id in held:
            return
        if len(held) >= tenant.max_sessions:
            raise sessions_exceeded(tenant, len(held))
        held.add(session_id)

    async def release_session(self, tenant: Tenant, session_id: str) -> None:
        self._sessions[tenant.name].discard(session_id)

    async def renew_sessions(self, held: Mapping[str, Tenant]) -> None:
        return None

    def sessions_held(self, tenant: Tenant) -> int:
        return len(self._sessions[tenant.name])

    async def charge_run(self, tenant: Tenant) -> None:
        now = self._clock()
        window = self._runs[tenant.name]
        while window and now - window[0] >= WINDOW_S:
            window.popleft()
        if len(window) >= tenant.executions_per_minute:
            raise runs_exceeded(tenant, WINDOW_S - (now - window[0]))
        window.append(now)

    async def close(self) -> None:
        return None
