"""A session tells its owner about faults and its end through callbacks; the pool's reaper retries kills.

The session runs over real socketpairs, their far ends playing the env's process and the jail's
pid 1 (a real sandbox fault cannot be provoked on purpose, and a real env would not send every
lie). The reaper's give-up path needs a zygote that never confirms an exit, which a real zygote
does not do, so that one test uses a stand-in.
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


async def test_a_fault_pid_1_reports_reaches_the_owner_and_closing_releases_the_session_once() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    witness_ours, witness_theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    env, pid1 = await Channel.open(theirs), await Channel.open(witness_theirs)
    faults: list[None] = []
    closed: list[SandboxSession] = []
    session = SandboxSession(
        None,
        None,
        None,
        await Channel.open(ours),
        step_seconds=5.0,
        witness=await Channel.open(witness_ours),
        on_fault=lambda: faults.append(None),
        on_close=closed.append,
    )
    try:
        await pid1.send({"op": "fault", "error": "seccomp filter missing"})
        env.close()  # the env's process never started
        await session.begin({"code": "", "seed": 0}, timeout_s=5.0)
        assert session.initial.outcome is Outcome.SANDBOX_FAULT
        assert "seccomp filter missing" in session.initial.observation
        assert len(faults) == 1 and closed == [session] and not session.alive
        await session.close()  # idempotent: the owner is told once
        assert closed == [session]
        with pytest.raises(SessionEnded):
            await session.step("x")
    finally:
        pid1.close()
        ours.close()


def _outcome(**fields: object) -> dict[str, object]:
    base = {"observation": "o", "reward": 0.0, "terminated": False, "truncated": False, "info": {}}
    return {"op": "outcome", "outcome": {**base, "turn": 0, "max_turns": 3, "outcome": "ok", **fields}}


@pytest.mark.parametrize(
    ("claim", "expected"),
    [
        ({"op": "fault", "error": "I am the sandbox"}, Outcome.ENV_ERROR),
        (_outcome(outcome="sandbox_fault"), Outcome.ENV_ERROR),
        (_outcome(outcome="cpu_limit"), Outcome.ENV_ERROR),
        (_outcome(outcome="killed"), Outcome.ENV_ERROR),
        (_outcome(outcome="memory_limit"), Outcome.MEMORY_LIMIT),
    ],
)
async def test_the_env_channel_cannot_claim_the_sandboxs_outcomes(claim: dict, expected: Outcome) -> None:
    """Only the env's process writes on the env channel: what it says about the sandbox is a lie."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    env = await Channel.open(theirs)
    faults: list[None] = []
    session = SandboxSession(None, None, None, await Channel.open(ours), 5.0, on_fault=lambda: faults.append(None))
    try:
        await env.send(claim)
        await session.begin({"code": ""}, timeout_s=5.0)
        assert session.initial.outcome is expected, session.initial
        assert faults == []
    finally:
        env.close()
        await session.close()


@pytest.mark.parametrize(
    "claim",
    [
        {"op": "outcome"},
        {"op": "outcome", "outcome": 5},
        {"op": "outcome", "outcome": [["observation", "x"]]},
        {"op": "outcome", "outcome": {"turn": "x"}},
        {"op": "outcome", "outcome": {"info": [1, 2]}},
        {"op": "outcome", "outcome": {"reward": [1]}},
        {"op": "outcome", "outcome": {"max_turns": {"a": 1}}},
        {"op": "outcome", "outcome": {"outcome": ["ok"]}},
        {"op": ["outcome"]},
        {"op": "env_error", "error": "x" * 100_000},
    ],
)
async def test_an_outcome_of_the_wrong_shape_is_the_envs_error(claim: dict) -> None:
    """Whatever fields the env's process sends, the session ends as env_error with the reason, no fault."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    env = await Channel.open(theirs)
    faults: list[None] = []
    session = SandboxSession(None, None, None, await Channel.open(ours), 5.0, on_fault=lambda: faults.append(None))
    try:
        await env.send(claim)
        await session.begin({"code": ""}, timeout_s=5.0)
        assert session.initial.outcome is Outcome.ENV_ERROR, session.initial
        assert 0 < len(session.initial.observation) <= 600 and faults == []
        assert session.closed
    finally:
        env.close()
        await session.close()


async def test_rewards_turns_and_the_turn_cap_are_the_services_own_count() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    env = await Channel.open(theirs)
    session = SandboxSession(None, None, None, await Channel.open(ours), 5.0, max_turns=2)
    try:
        await env.send(_outcome(max_turns=50))
        await session.begin({"code": ""}, timeout_s=5.0)
        assert (session.initial.turn, session.initial.max_turns) == (0, 2)
        await env.send(_outcome(reward=7.5, turn=0, max_turns=50))  # the env lies about its turn and reward
        first = await session.step("a")
        assert (first.turn, first.reward, first.outcome) == (1, 1.0, Outcome.OK)
        await env.send(_outcome(turn=0, max_turns=50))
        second = await session.step("b")
        assert (second.turn, second.truncated, second.outcome) == (2, True, Outcome.LIMIT)
        assert not session.alive
    finally:
        env.close()
        await session.close()


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
