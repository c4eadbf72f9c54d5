"""Per-tenant quotas: concurrent sessions and executions (validations included) per minute."""

from __future__ import annotations

import time
from collections import defaultdict, deque
from collections.abc import Callable

from services.sandbox.core.auth import Tenant
from services.sandbox.core.errors import QuotaExceeded


class Quotas:
    """Counts what each tenant holds and refuses what goes over its quota.

    Args:
        clock: Monotonic clock in seconds (injectable for tests).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._sessions: dict[str, int] = defaultdict(int)
        self._runs: dict[str, deque[float]] = defaultdict(deque)

    def acquire_session(self, tenant: Tenant) -> None:
        """Reserve one concurrent session for ``tenant`` (release with ``release_session``)."""
        held = self._sessions[tenant.name]
        if held >= tenant.max_sessions:
            raise QuotaExceeded(
                f"tenant {tenant.name!r} already holds {held} open sessions, its limit is "
                f"{tenant.max_sessions}: close sessions you no longer need"
            )
        self._sessions[tenant.name] = held + 1

    def release_session(self, tenant: Tenant) -> None:
        self._sessions[tenant.name] = max(0, self._sessions[tenant.name] - 1)

    def sessions_held(self, tenant: Tenant) -> int:
        return self._sessions[tenant.name]

    def charge_run(self, tenant: Tenant) -> None:
        """Count one execution or validation against the tenant's per-minute rate."""
        now = self._clock()
        window = self._runs[tenant.name]
        while window and now - window[0] >= 60.0:
            window.popleft()
        if len(window) >= tenant.executions_per_minute:
            retry_in = 60.0 - (now - window[0])
            raise QuotaExceeded(
                f"tenant {tenant.name!r} reached {tenant.executions_per_minute} executions per minute: "
                f"retry in {retry_in:.0f} s"
            )
        window.append(now)
