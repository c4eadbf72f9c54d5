"""Attacks from env code through sessions: contained, each ending with its own honest outcome.

An env's code runs in the session's env process, so a hostile env is untrusted code too: whatever
it does at load, reset or step must stay in its jail, end with the outcome that says what happened
(``env_error``, ``timeout``, ``memory_limit``, ``cpu_limit``, ``output_limit``, ``killed``) and leave
the pool healthy. Attacks on validation verdicts are in ``test_verdicts.py``.
"""

from __future__ import annotations

import asyncio
import json
import textwrap
from pathlib import Path

import pytest

from services.sandbox.isolation import SandboxPool
from spade.envs import CheckConfig, Outcome
from spade.envs.examples import EXAMPLES
from spade.envs.types import FinishReason
from tests.security.conftest import SECRET
from tests.security.test_escapes import assert_healthy

pytestmark = pytest.mark.asyncio(loop_scope="session")

CONFIG = CheckConfig()


def env(reset_body: str, step_body: str = "return 'ok', 0.0, False, False, {}") -> str:
    """A minimal game env whose reset/step run the given (hostile) bodies."""
    return textwrap.dedent(
        """
        import json, os, random, signal, time

        class HostileEnv:
            max_turns = 5

            def reset(self, seed=None):
                self.rng = random.Random(seed)
        {reset}

            def step(self, action):
        {step}

            def solution(self):
                return ["\\\\boxed{{done}}"]
        """
    ).format(reset=textwrap.indent(reset_body, " " * 8), step=textwrap.indent(step_body, " " * 8))


async def test_env_cannot_read_host_secrets(pool: SandboxPool, planted: dict[str, Path]) -> None:
    code = env(
        f"""
found = {{}}
for name, path in (("tmp", {str(planted["tmp"])!r}), ("root", {str(planted["root"])!r})):
    try:
        found[name] = open(path).read()
    except OSError as exc:
        found[name] = type(exc).__name__
found["env"] = {{k: v for k, v in os.environ.items()}}
return json.dumps(found), {{}}
"""
    )
    session = await pool.open_session(code, "game", 1, CONFIG)
    try:
        assert session.initial.outcome is Outcome.OK, session.initial
        seen = json.loads(session.initial.observation)
        assert seen["tmp"] == "FileNotFoundError" and seen["root"] == "FileNotFoundError"
        assert SECRET not in session.initial.observation
        assert not any(key.startswith("SPADE") for key in seen["env"])
    finally:
        await session.close()
    await assert_healthy(pool)


async def test_sessions_have_private_tmpfs(pool: SandboxPool) -> None:
    writer = env("open('/tmp/mine', 'w').write('a')\nreturn str(sorted(os.listdir('/tmp'))), {}")
    reader = env("return str(sorted(os.listdir('/tmp'))), {}")
    first = await pool.open_session(writer, "game", 1, CONFIG)
    second = await pool.open_session(reader, "game", 1, CONFIG)
    try:
        assert first.initial.observation == "['mine']"
        assert second.initial.observation == "[]"
    finally:
        await first.close()
        await second.close()


async def test_step_that_hangs_is_timed_out_by_the_service(pool: SandboxPool) -> None:
    # The env disarms the in-process call timer; the service's own step clock still ends it.
    code = env(
        "return 'ready', {}",
        "signal.signal(signal.SIGALRM, signal.SIG_IGN)\nwhile True:\n    pass",
    )
    session = await pool.open_session(code, "game", 1, CONFIG)
    assert session.initial.outcome is Outcome.OK
    outcome = await session.step("\\boxed{go}")
    assert outcome.outcome is Outcome.TIMEOUT and outcome.truncated
    assert not session.alive
    await assert_healthy(pool)


async def test_oversized_reply_is_an_output_limit(pool: SandboxPool) -> None:
    size = pool.settings.observation_bytes + 1024
    code = env(f"return 'ok', {{'blob': 'x' * {size}}}")
    session = await pool.open_session(code, "game", 1, CONFIG)
    assert session.initial.outcome is Outcome.OUTPUT_LIMIT, session.initial
    assert FinishReason.for_outcome(session.initial.outcome) is FinishReason.FAULT_OUTPUT
    assert not session.alive
    await assert_healthy(pool)


async def test_env_that_kills_its_own_process_is_killed(pool: SandboxPool) -> None:
    code = env("return 'ready', {}", "os.kill(os.getpid(), signal.SIGSEGV)")
    session = await pool.open_session(code, "game", 1, CONFIG)
    assert session.initial.outcome is Outcome.OK
    outcome = await session.step("\\boxed{go}")
    assert outcome.outcome is Outcome.KILLED and "SIGSEGV" in outcome.observation, outcome
    await assert_healthy(pool)


async def test_memory_bomb_in_a_session_is_a_memory_fault_not_a_truncation(pool: SandboxPool) -> None:
    for code in (
        env("blocks = []\nwhile True:\n    blocks.append(bytes(64 << 20))"),
        env("return 'ready', {}", "blocks = []\nwhile True:\n    blocks.append(bytes(64 << 20))"),
    ):
        session = await pool.open_session(code, "game", 1, CONFIG)
        outcome = session.initial
        if outcome.outcome is Outcome.OK:
            outcome = await session.step("\\boxed{go}")
        assert outcome.outcome is Outcome.MEMORY_LIMIT, outcome
        assert FinishReason.for_outcome(outcome.outcome) is FinishReason.FAULT_MEMORY
        assert not session.alive
    await assert_healthy(pool)


async def test_env_fork_bomb_is_contained(pool: SandboxPool) -> None:
    code = env("while True:\n    try:\n        os.fork()\n    except OSError:\n        pass")
    session = await pool.open_session(code, "game", 1, CONFIG)
    assert session.initial.outcome in (Outcome.TIMEOUT, Outcome.CPU_LIMIT, Outcome.KILLED), session.initial
    await session.close()
    await assert_healthy(pool)


async def test_concurrent_sessions_play_independently(pool: SandboxPool) -> None:
    example = EXAMPLES["counterfeit_coin"]
    sessions = await asyncio.gather(*(pool.open_session(example.code, "game", seed, CONFIG) for seed in range(4)))
    try:
        assert all(s.initial.outcome is Outcome.OK for s in sessions)
        steps = await asyncio.gather(*(s.step("\\boxed{weigh 1 | 2}") for s in sessions))
        assert all(o.outcome is Outcome.OK and o.turn == 1 for o in steps)
    finally:
        await asyncio.gather(*(s.close() for s in sessions))
    assert pool.health()["sessions"] == 0
