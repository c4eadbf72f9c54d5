"""Attacks from env code, through sessions and validation: contained, with the right outcome.

An env's code runs inside the session process, so a hostile env is untrusted code too: whatever it
does at load, reset or step must stay in its jail, end with an explicit outcome (``env_error``,
``timeout``, ``limit``) and leave the pool healthy.
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


async def test_oversized_reply_is_a_limit(pool: SandboxPool) -> None:
    size = pool.settings.observation_bytes + 1024
    code = env(f"return 'ok', {{'blob': 'x' * {size}}}")
    session = await pool.open_session(code, "game", 1, CONFIG)
    assert session.initial.outcome is Outcome.LIMIT, session.initial
    assert not session.alive
    await assert_healthy(pool)


async def test_env_that_kills_its_own_process_is_an_env_error(pool: SandboxPool) -> None:
    code = env("return 'ready', {}", "os.kill(os.getpid(), signal.SIGSEGV)")
    session = await pool.open_session(code, "game", 1, CONFIG)
    assert session.initial.outcome is Outcome.OK
    outcome = await session.step("\\boxed{go}")
    assert outcome.outcome in (Outcome.ENV_ERROR, Outcome.LIMIT), outcome
    assert outcome.outcome is not Outcome.SANDBOX_FAULT
    await assert_healthy(pool)


async def test_env_fork_bomb_and_memory_bomb_are_contained(pool: SandboxPool) -> None:
    bombs = [
        env("while True:\n    try:\n        os.fork()\n    except OSError:\n        pass"),
        env("blocks = []\nwhile True:\n    blocks.append(bytearray(16 << 20))"),
    ]
    for code in bombs:
        session = await pool.open_session(code, "game", 1, CONFIG)
        assert session.initial.outcome in (Outcome.ENV_ERROR, Outcome.TIMEOUT, Outcome.LIMIT), session.initial
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


async def test_validation_stopped_mid_check_names_the_check(pool: SandboxPool) -> None:
    code = env(
        "return 'ready', {}",
        "signal.signal(signal.SIGALRM, signal.SIG_IGN)\nwhile True:\n    pass",
    )
    report = await pool.validate(code, "game", CONFIG)
    assert not report.valid
    stopped = [c for c in report.checks if c.detail.startswith("stopped while running")]
    assert [c.name for c in stopped] == ["smoke"], report.checks
    assert "wall-clock limit" in stopped[0].detail or "CPU-time limit" in stopped[0].detail
    assert report.check("syntax").passed and report.check("structure").passed
    await assert_healthy(pool)


async def test_hostile_env_cannot_forge_a_valid_report(pool: SandboxPool) -> None:
    # The env's module code runs in the checker's process: an env that reaches for the report
    # channel finds it is not a file it can open, and one that exits early is reported stopped.
    code = env("return 'ready', {}") + "\nimport os\nos._exit(0)\n"
    report = await pool.validate(code, "game", CONFIG)
    assert not report.valid
    await assert_healthy(pool)


async def test_validation_report_flood_is_bounded(pool: SandboxPool) -> None:
    # Module code floods the report channel with one enormous frame announcement.
    code = env("return 'ready', {}") + (
        "\nimport socket, struct\nsocket.socket(fileno=3).sendall(struct.pack('>I', 2**31) + b'x' * 65536)\n"
    )
    report = await pool.validate(code, "game", CONFIG)
    assert not report.valid
    # Whether the service reads the oversized frame header before it sees the process end is a race;
    # either way the report must say the checker was cut off, never pass a check it did not run.
    details = " ".join(c.detail for c in report.checks)
    assert "misbehaved" in details or "stopped" in details, report.checks
    await assert_healthy(pool)
