"""Each way an env's process can end a session has its own outcome, told by the jail's pid 1.

A pool with a one-second CPU budget per session and generous wall clocks, so that a CPU spin meets
its CPU limit before any clock; the process killed from outside is found on the host by its pid in
the jail's namespace (the env's process is the only pid 2 of a session jail).
"""

from __future__ import annotations

import asyncio
import os
import signal
import textwrap
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from services.sandbox.isolation import IsolationSettings, SandboxPool
from spade.envs import CheckConfig, Outcome
from spade.envs.types import FinishReason
from tests.security.conftest import sandbox_pids

pytestmark = pytest.mark.asyncio(loop_scope="session")

PATIENT = CheckConfig(call_time_limit_s=30.0)
"""No per-call timer before the CPU limit or the kill under test."""


def env(step_body: str) -> str:
    return textwrap.dedent(
        """
        import os, time

        class OutcomeEnv:
            max_turns = 5

            def reset(self, seed=None):
                return "ready", {{}}

            def step(self, action):
        {step}

            def solution(self):
                return ["\\\\boxed{{go}}"]
        """
    ).format(step=textwrap.indent(step_body, " " * 8))


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def pool() -> AsyncIterator[SandboxPool]:
    pool = SandboxPool(
        IsolationSettings(session_cpu_seconds=1.0, step_seconds=60.0, session_start_seconds=30.0, memory_mb=256)
    )
    await pool.start()
    instance = pool.instance
    assert instance
    try:
        yield pool
    finally:
        await pool.stop()
    deadline = time.monotonic() + 3.0
    while (left := {p: c for p, c in sandbox_pids().items() if instance in c}) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert not left, f"sandbox processes outlived the pool: {left}"


def env_process(instance: str) -> int:
    """Host pid of the one session env process of the pool ``instance``.

    It is pid 2 of its jail, like the waiters of the spare jails; it alone has the env channel
    (fds 0-3; a waiter holds only its handoff socket).
    """
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().decode("utf-8", "replace")
            nspid = next(line for line in (entry / "status").read_text().splitlines() if line.startswith("NSpid:"))
        except (OSError, StopIteration):
            continue
        if instance in cmdline and nspid.split()[-1] == "2" and len(os.listdir(entry / "fd")) == 4:
            found.append(int(entry.name))
    assert len(found) == 1, found
    return found[0]


async def play_one_step(pool: SandboxPool, code: str) -> Outcome:
    session = await pool.open_session(code, "game", 1, PATIENT)
    assert session.initial.outcome is Outcome.OK, session.initial
    outcome = await session.step("\\boxed{go}")
    assert not session.alive and outcome.truncated and not outcome.terminated
    return outcome.outcome


async def test_a_cpu_spin_is_a_cpu_limit(pool: SandboxPool) -> None:
    outcome = await play_one_step(pool, env("while True:\n    pass"))
    assert outcome is Outcome.CPU_LIMIT
    assert FinishReason.for_outcome(outcome) is FinishReason.FAULT_CPU


async def test_a_memory_bomb_is_a_memory_limit(pool: SandboxPool) -> None:
    # Pages really written (bytearray zero-fills): the bomb fills memory, not only address space.
    outcome = await play_one_step(pool, env("hog = []\nwhile True:\n    hog.append(bytearray(64 << 20))"))
    assert outcome is Outcome.MEMORY_LIMIT


async def test_sigkill_from_outside_is_killed(pool: SandboxPool) -> None:
    assert pool.instance
    session = await pool.open_session(env("time.sleep(50)\nreturn 'late', 0.0, False, False, {}"), "game", 1, PATIENT)
    step = asyncio.create_task(session.step("\\boxed{go}"))
    await asyncio.sleep(0.5)
    os.kill(env_process(pool.instance), signal.SIGKILL)
    outcome = await step
    assert outcome.outcome is Outcome.KILLED and "SIGKILL" in outcome.observation, outcome
    assert FinishReason.for_outcome(outcome.outcome) is FinishReason.FAULT_KILLED


async def test_the_turn_cap_is_a_limit_and_nothing_else(pool: SandboxPool) -> None:
    session = await pool.open_session(
        env("return 'again', 0.0, False, False, {}"), "game", 1, CheckConfig(max_turns_cap=2)
    )
    first = await session.step("\\boxed{go}")
    second = await session.step("\\boxed{go}")
    assert (first.outcome, second.outcome, second.truncated) == (Outcome.OK, Outcome.LIMIT, True)
    assert FinishReason.for_outcome(second.outcome) is FinishReason.TURN_LIMIT
