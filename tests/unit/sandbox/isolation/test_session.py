"""A session tells its owner about faults and its end through callbacks; the pool's reaper retries kills.

The session runs over a real socketpair, its far end playing a session process that reports a
sandbox fault (a real one cannot be provoked on purpose). The reaper's give-up path needs a zygote
that never confirms an exit, which a real zygote does not do, so that one test uses a stand-in.
"""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass, field

import pytest

from services.sandbox.isolation import SandboxPool
from services.sandbox.isolation import pool as pool_module
from services.sandbox.isolation.channels import Channel
from services.sandbox.isolation.session import SandboxSession, SessionEnded
from spade.envs import Outcome


async def test_a_reported_fault_reaches_the_owner_and_closing_releases_the_session_once() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    peer = await Channel.open(theirs)
    faults: list[None] = []
    closed: list[SandboxSession] = []
    session = SandboxSession(
        None,
        None,
        None,
        await Channel.open(ours),
        step_seconds=5.0,
        on_fault=lambda: faults.append(None),
        on_close=closed.append,
    )
    try:
        await peer.send({"op": "fault", "error": "seccomp filter missing"})
        await session.begin({"code": "", "seed": 0}, timeout_s=5.0)
        assert session.initial.outcome is Outcome.SANDBOX_FAULT
        assert "seccomp filter missing" in session.initial.observation
        assert len(faults) == 1 and closed == [session] and not session.alive
        assert await peer.recv() == {"code": "", "seed": 0}  # what begin() sent
        await session.close()  # idempotent: the owner is told once
        assert closed == [session]
        with pytest.raises(SessionEnded):
            await session.step("x")
    finally:
        peer.close()
        ours.close()


@dataclass
class _StuckZygote:
    """A zygote whose requests never confirm their end."""

    kills: int = 0
    closed: bool = False

    async def kill(self, request: object) -> None:
        self.kills += 1

    async def close(self, timeout_s: float = 5.0) -> None:
        self.closed = True


@dataclass
class _Request:
    request_id: int = 7
    exited: asyncio.Future[dict[str, object]] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


async def test_a_request_that_outlives_every_kill_counts_a_fault_and_gives_its_zygote_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(pool_module, "EXIT_GRACE_S", 0.01)
    pool = SandboxPool()
    zygote = _StuckZygote()
    await pool._reap(zygote, _Request())  # type: ignore[arg-type]
    assert zygote.kills == pool_module.REAP_RETRY.attempts == 2
    assert zygote.closed and pool.faults == 1

    confirmed = _StuckZygote()
    request = _Request()
    request.exited.set_result({"code": 0})
    await pool._reap(confirmed, request)  # type: ignore[arg-type]
    assert confirmed.kills == 1 and not confirmed.closed and pool.faults == 1
