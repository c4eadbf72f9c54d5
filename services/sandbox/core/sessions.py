"""Live env sessions: ownership, TTL for abandoned sessions, a global cap, one step at a time each.

A session that ends (its episode terminated or was truncated, its code failed to load, its process
failed) stops counting against the tenant's quota and the service's cap at once: its process is
closed then, and only a tombstone stays, so that a step on it is answered "finished" (409) and a
DELETE still succeeds, until the caller deletes it or the idle TTL removes it.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from services.sandbox.core.auth import Tenant
from services.sandbox.core.errors import QuotaExceeded, SessionFinished, SessionNotFound
from services.sandbox.core.quotas import QuotaStore


class Outcome(Protocol):
    """What a sandboxed session returns after reset or step (``spade.envs.StepOutcome``)."""

    terminated: bool
    truncated: bool
    outcome: Any


class LiveSession(Protocol):
    """A session process in the sandbox."""

    @property
    def initial(self) -> Any: ...

    async def step(self, action: str) -> Any: ...

    async def close(self) -> None: ...


Opener = Callable[[str, str, int, Any], Awaitable[LiveSession]]
"""Opens a sandboxed session from ``(code, setting, seed, options)`` (options: the opener's own, passed through)."""


@dataclass
class _Entry:
    tenant: Tenant
    live: LiveSession
    last_used: float
    finished: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


def _is_final(outcome: Any) -> bool:
    kind = getattr(getattr(outcome, "outcome", None), "value", getattr(outcome, "outcome", "ok"))
    return bool(outcome.terminated or outcome.truncated or kind not in ("ok", None))


class SessionManager:
    """Owns every live session of this replica.

    Args:
        opener: Opens a sandboxed session (see ``Opener``).
        quotas: Where the tenants' concurrent sessions are counted.
        ttl_s: A session idle this long is closed by ``reap``.
        max_sessions: Cap across all tenants (protects the host).
        clock: Monotonic clock (injectable for tests).
    """

    def __init__(
        self,
        opener: Opener,
        quotas: QuotaStore,
        *,
        ttl_s: float,
        max_sessions: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._opener = opener
        self._quotas = quotas
        self._ttl_s = ttl_s
        self._max = max_sessions
        self._clock = clock
        self._sessions: dict[str, _Entry] = {}
        self._opening = 0

    def __len__(self) -> int:
        """Live sessions (ended ones are not counted)."""
        return sum(1 for e in self._sessions.values() if not e.finished) + self._opening

    def live(self) -> dict[str, Tenant]:
        """Session id -> tenant of every live session."""
        return {sid: e.tenant for sid, e in self._sessions.items() if not e.finished}

    async def open(
        self,
        tenant: Tenant,
        code: str,
        setting: str,
        seed: int,
        charge: Callable[[Tenant], Awaitable[None]] | None = None,
        options: Any = None,
    ) -> tuple[str, Any]:
        """Open a session; returns its id and the outcome of ``reset(seed)``.

        Args:
            charge: Called once the session has its slot, before it opens (the run rate; a session
                refused its slot is not charged).
            options: Passed to the opener as they are.
        """
        if len(self) >= self._max:
            raise QuotaExceeded(f"the service holds its maximum of {self._max} live sessions: retry shortly")
        session_id = secrets.token_urlsafe(16)
        await self._quotas.acquire_session(tenant, session_id)
        self._opening += 1
        try:
            if charge is not None:
                await charge(tenant)
            live = await self._opener(code, setting, seed, options)
        except BaseException:
            await self._quotas.release_session(tenant, session_id)
            raise
        finally:
            self._opening -= 1
        entry = _Entry(tenant=tenant, live=live, last_used=self._clock())
        self._sessions[session_id] = entry
        if _is_final(live.initial):
            await self._end(session_id, entry)
        return session_id, live.initial

    async def _end(self, session_id: str, entry: _Entry) -> None:
        """The session's episode is over: free its process and its quota now, keep a tombstone."""
        if entry.finished:
            return
        entry.finished = True
        await self._quotas.release_session(entry.tenant, session_id)
        await entry.live.close()

    def _get(self, tenant: Tenant, session_id: str) -> _Entry:
        """The caller's own session; another tenant's is answered exactly like one that does not exist
        (the same error and message), so an id tells a caller nothing about anyone else's sessions."""
        entry = self._sessions.get(session_id)
        if entry is None or entry.tenant.name != tenant.name:
            raise SessionNotFound(
                f"no session {session_id[:64]!r}: it never existed, was closed, or expired after "
                f"{self._ttl_s:.0f} s idle; open a new one"
            )
        return entry

    async def step(self, tenant: Tenant, session_id: str, action: str) -> Any:
        """Send one action; steps are serialised per session."""
        entry = self._get(tenant, session_id)
        async with entry.lock:
            if session_id not in self._sessions:
                raise SessionNotFound(f"session {session_id[:64]!r} was closed while this step waited")
            if entry.finished:
                raise SessionFinished(
                    f"session {session_id[:64]!r} has ended (terminated, truncated or failed): "
                    "open a new session to play again"
                )
            entry.last_used = self._clock()
            try:
                outcome = await entry.live.step(action)
            except BaseException:
                await self._end(session_id, entry)  # its process's state is unknown: end it
                raise
            entry.last_used = self._clock()
            if _is_final(outcome):
                await self._end(session_id, entry)
            return outcome

    async def close(self, tenant: Tenant, session_id: str) -> None:
        self._get(tenant, session_id)
        await self._drop(session_id)

    async def _drop(self, session_id: str) -> None:
        entry = self._sessions.pop(session_id, None)
        if entry is not None:
            await self._end(session_id, entry)

    async def reap(self) -> int:
        """Close sessions idle longer than the TTL; returns how many were closed."""
        now = self._clock()
        stale = [sid for sid, e in self._sessions.items() if now - e.last_used > self._ttl_s and not e.lock.locked()]
        for sid in stale:
            await self._drop(sid)
        return len(stale)

    async def close_all(self) -> None:
        for sid in list(self._sessions):
            await self._drop(sid)
