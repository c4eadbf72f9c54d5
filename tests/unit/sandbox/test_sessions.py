"""The session manager: ended sessions stop counting at once; steps are one at a time; TTL and caps.

The manager is pure core; its sessions here are plain objects with the live session's interface.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from services.sandbox.core.auth import Tenant
from services.sandbox.core.errors import QuotaExceeded, SessionFinished, SessionNotFound
from services.sandbox.core.quotas import LocalQuotas
from services.sandbox.core.sessions import SessionManager
from spade.envs import Outcome, StepOutcome

ALICE = Tenant(name="alice", max_sessions=1, executions_per_minute=100)


def outcome(*, terminated: bool = False, kind: Outcome = Outcome.OK) -> StepOutcome:
    return StepOutcome("o", 1.0 if terminated else 0.0, terminated, kind is not Outcome.OK, {}, 0, 5, kind)


@dataclass
class FakeLive:
    initial: StepOutcome
    script: list[StepOutcome] = field(default_factory=list)
    closed: int = 0

    async def step(self, action: str) -> StepOutcome:
        return self.script.pop(0)

    async def close(self) -> None:
        self.closed += 1


def manager(*lives: FakeLive, max_sessions: int = 10, clock: list[float] | None = None) -> SessionManager:
    queue = list(lives)

    async def opener(code: str, setting: str, seed: int, options: object) -> FakeLive:
        return queue.pop(0)

    now = clock or [0.0]
    return SessionManager(opener, LocalQuotas(), ttl_s=60.0, max_sessions=max_sessions, clock=lambda: now[0])


async def test_a_finished_episode_frees_its_quota_and_process_at_once() -> None:
    first = FakeLive(outcome(), [outcome(terminated=True)])
    sessions = manager(first, FakeLive(outcome()))
    sid, _ = await sessions.open(ALICE, "code", "game", 0)
    assert (await sessions.step(ALICE, sid, "win")).terminated
    assert first.closed == 1 and len(sessions) == 0
    second, _ = await sessions.open(ALICE, "code", "game", 0)  # no DELETE needed first
    with pytest.raises(SessionFinished):
        await sessions.step(ALICE, sid, "again")
    await sessions.close(ALICE, sid)  # the tombstone still answers a DELETE
    with pytest.raises(SessionNotFound):
        await sessions.close(ALICE, sid)
    assert first.closed == 1 and len(sessions) == 1 and second


async def test_a_failed_load_never_holds_a_slot() -> None:
    broken = FakeLive(outcome(kind=Outcome.ENV_ERROR))
    sessions = manager(broken, FakeLive(outcome()), max_sessions=1)
    await sessions.open(ALICE, "broken", "game", 0)
    assert broken.closed == 1 and len(sessions) == 0
    await sessions.open(ALICE, "code", "game", 0)
    with pytest.raises(QuotaExceeded, match="maximum of 1 live sessions"):
        await sessions.open(ALICE, "code", "game", 0)


async def test_idle_sessions_and_tombstones_expire() -> None:
    now = [0.0]
    live = FakeLive(outcome())
    sessions = manager(live, clock=now)
    sid, _ = await sessions.open(ALICE, "code", "game", 0)
    now[0] = 61.0
    assert await sessions.reap() == 1 and live.closed == 1
    with pytest.raises(SessionNotFound):
        await sessions.step(ALICE, sid, "x")
