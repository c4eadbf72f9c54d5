"""Attacks on the validation verdict from env code: forged frames, patched checkers, swapped code.

The checker runs in the service and plays every episode through a real session, whose env process
is jailed like a rollout's play (``services/sandbox/isolation/validation.py``). Each attack below is
really attempted from the env's code and must leave the verdict the genuine one: every test uses an
env with a real defect (its ``solution()`` does not win) and requires that defect to be found, or
the attack itself to fail the env, never a pass.
"""

from __future__ import annotations

import json
import textwrap

import pytest

from services.sandbox.isolation import SandboxPool
from spade.envs import CHECK_NAMES, CheckConfig, Outcome, ValidationReport
from spade.envs.examples import EXAMPLES
from spade.envs.repair import repair_code
from tests.security.test_escapes import assert_healthy

pytestmark = pytest.mark.asyncio(loop_scope="session")

CONFIG = CheckConfig()
# An example no random policy wins (counterfeit_coin's ~5% random wins failed its random_policy check
# about once in 50 validations on secret seeds: a baseline that flaked).
GOOD = EXAMPLES["code_breaker"].code
# A real defect for the checker to find: solution() guesses a code that differs from the secret in every
# digit (still a function of the seed, so only solution_replay fails, never seed_variety).
BROKEN = GOOD.replace('" ".join(map(str, self.code))', '" ".join(str(d % self.DIGITS + 1) for d in self.code)', 1)

FORGED = {
    "op": "report",
    "report": {
        "valid": True,
        "setting": "game",
        "env_class": "ForgedEnv",
        "checks": [{"name": name, "passed": True, "detail": "FORGED"} for name in CHECK_NAMES],
        "repaired_code": "print('swapped in')\n",
        "duration_ms": 1.0,
    },
}
FORGE_AT_IMPORT = textwrap.dedent(
    f"""
    import json as _json, os as _os, struct as _struct
    _body = _json.dumps({FORGED!r}).encode()
    _frame = _struct.pack(">I", len(_body)) + _body
    for _fd in range(64):  # every descriptor this process has: the report channel, if it were here
        try:
            _os.write(_fd, _frame)
        except OSError:
            pass
    """
)


def inject(code: str, method: str, body: str) -> str:
    """``code`` with ``body`` run first thing in ``method`` of its env class."""
    start = code.index(f"    def {method}(")
    end = code.index(":\n", start) + 2
    assert code.count(f"    def {method}(") == 1
    return code[:end] + textwrap.indent(textwrap.dedent(body), " " * 8) + code[end:]


def details(report: ValidationReport) -> str:
    return " ".join(c.detail for c in report.checks)


def assert_genuine(report: ValidationReport, code: str) -> None:
    """Nothing of the forged report made it into the real one."""
    assert not report.valid
    assert report.env_class != "ForgedEnv" and "FORGED" not in details(report)
    assert report.repaired_code == repair_code(code)[0]
    assert [c.name for c in report.checks] == list(CHECK_NAMES)


async def test_the_broken_env_is_refused_for_its_defect(pool: SandboxPool) -> None:
    """The baseline every attack below is measured against."""
    assert (await pool.validate(GOOD, "game", CONFIG)).valid
    report = await pool.validate(BROKEN, "game", CONFIG)
    assert not report.valid and [c.name for c in report.failed] == ["solution_replay"], report.summary()


async def test_hostile_env_cannot_forge_a_valid_report(pool: SandboxPool) -> None:
    code = FORGE_AT_IMPORT + BROKEN
    report = await pool.validate(code, "game", CONFIG)
    assert_genuine(report, code)
    # The forged frame was really sent, on the only channel the env's process has: its session's
    # channel, where the service took it for what it is.
    structure = report.check("structure")
    assert not structure.passed and "sent 'report' instead of an outcome" in structure.detail, structure.detail
    await assert_healthy(pool)


async def test_forging_mid_check_is_refused_too(pool: SandboxPool) -> None:
    code = inject(BROKEN, "solution", FORGE_AT_IMPORT)
    report = await pool.validate(code, "game", CONFIG)
    assert_genuine(report, code)
    assert not report.check("solution_replay").passed
    await assert_healthy(pool)


PATCH_THE_CHECKER = textwrap.dedent(
    """
    import spade.envs.checker as _checker, spade.envs.check_context as _ctx, spade.envs.findings as _findings
    import spade.envs.session as _session, spade.envs.types as _types

    def _pass(ctx):
        return "PATCHED"

    _checker.check_solution_replay = _pass
    _checker.CHECKS = {name: _ctx.EnvCheck(name, _pass) for name in _types.CHECK_NAMES}
    _checker.check_env_source = lambda *a, **k: None
    _ctx.CheckContext.check_turns = lambda *a, **k: None
    _ctx.CheckContext.solution = lambda self, session, seed: []
    _findings.CheckFailed = type("CheckFailed", (BaseException,), {})
    _session.EnvSession.step = lambda self, action: None
    _types.ValidationReport.valid = True
    """
)


async def test_patching_the_checker_modules_in_the_env_process_changes_nothing(pool: SandboxPool) -> None:
    code = PATCH_THE_CHECKER + BROKEN
    patched = await pool.validate(code, "game", CONFIG)
    assert_genuine(patched, code)
    assert "PATCHED" not in details(patched)
    # The patched modules live only in the env's own process: the checker's are untouched. What the
    # env patched there is its own session's host, which then breaks every play of it alike.
    assert patched.check("structure").passed
    smoke = patched.check("smoke")
    assert not smoke.passed and "env error" in smoke.detail, smoke.detail
    await assert_healthy(pool)


async def test_swapped_code_never_reaches_a_session(pool: SandboxPool) -> None:
    """A report (or any frame) naming other code cannot change what sessions of this env load."""
    code = FORGE_AT_IMPORT.replace("range(64)", "range(3, 4)") + GOOD
    report = await pool.validate(code, "game", CONFIG)
    assert report.repaired_code == repair_code(code)[0] != FORGED["report"]["repaired_code"]  # type: ignore[index]
    assert pool.repairs.known(code) == repair_code(code)[0]
    session = await pool.open_session(code, "game", 3, CONFIG)
    try:
        # The env's process writes the forged frame on its own session channel at import: the
        # service reads it as the env's (malformed) answer, never as code or a verdict.
        assert session.initial.outcome is Outcome.ENV_ERROR and "'report'" in session.initial.observation
    finally:
        await session.close()
    clean = await pool.open_session(GOOD, "game", 3, CONFIG)
    try:
        assert clean.initial.outcome is Outcome.OK and "swapped" not in clean.initial.observation
    finally:
        await clean.close()


async def test_env_code_that_exits_fails_the_check_it_exits_in(pool: SandboxPool) -> None:
    at_import = "import os as _os\n_os._exit(0)\n" + GOOD
    report = await pool.validate(at_import, "game", CONFIG)
    assert not report.valid and "exited (code 0)" in report.check("structure").detail, report.check("structure")
    in_step = inject(GOOD, "step", "import os; os._exit(3)\n")
    report = await pool.validate(in_step, "game", CONFIG)
    smoke = report.check("smoke")
    assert not smoke.passed and "exited (code 3)" in smoke.detail, smoke.detail
    assert report.check("structure").passed
    assert all(not c.detail.startswith("stopped while running") for c in report.checks)  # a full report
    await assert_healthy(pool)


SIGNAL_THE_CHECKER = textwrap.dedent(
    """
    import os as _os, signal as _signal
    for _sig in (_signal.SIGSTOP, _signal.SIGKILL, _signal.SIGTERM, _signal.SIGINT, _signal.SIGALRM, _signal.SIGUSR1):
        _os.kill(1, _sig)  # pid 1 of the jail: the witness of how the env process ends
    """
)


async def test_env_code_cannot_kill_stop_or_interrupt_the_checker(pool: SandboxPool) -> None:
    code = SIGNAL_THE_CHECKER + BROKEN
    report = await pool.validate(code, "game", CONFIG)
    # The kernel drops every signal sent to a pid namespace's init from inside it, and the checker
    # is not in the jail at all: it carried on and found the genuine defect.
    assert_genuine(report, code)
    assert [c.name for c in report.failed] == ["solution_replay"], report.summary()
    # -1 is every process the sender may signal but itself and init: here, nobody.
    everyone = "import os as _os, signal as _signal\n_os.kill(-1, _signal.SIGKILL)\n" + BROKEN
    report = await pool.validate(everyone, "game", CONFIG)
    assert "ProcessLookupError" in report.check("structure").detail, report.check("structure")
    await assert_healthy(pool)


async def test_a_huge_frame_on_the_session_channel_ends_the_session(pool: SandboxPool) -> None:
    code = GOOD + "\nimport socket, struct\nsocket.socket(fileno=3).sendall(struct.pack('>I', 2**31) + b'x' * 65536)\n"
    report = await pool.validate(code, "game", CONFIG)
    assert not report.valid
    assert "bytes, over the limit of" in report.check("structure").detail, report.check("structure")
    await assert_healthy(pool)


async def test_a_flood_of_well_formed_frames_is_not_taken_for_answers(pool: SandboxPool) -> None:
    reply = json.dumps({"ok": True, "class": "GoodEnv", "problems": [], "value": None, "rng": False})
    code = (
        "import os as _os, struct as _struct\n"
        f"_body = {reply!r}.encode()\n"
        "_frame = _struct.pack('>I', len(_body)) + _body\n"
        "for _ in range(2000):\n    _os.write(3, _frame)\n" + GOOD
    )
    report = await pool.validate(code, "game", CONFIG)
    structure = report.check("structure")
    assert not report.valid and "instead of an outcome" in structure.detail, structure.detail
    await assert_healthy(pool)


async def test_a_hung_env_call_fails_its_check_and_the_validation_goes_on(pool: SandboxPool) -> None:
    # The env disarms its call timer; the service's step clock ends the session.
    code = inject(GOOD, "step", "import signal\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\nwhile True:\n    pass\n")
    report = await pool.validate(code, "game", CheckConfig(call_time_limit_s=0.3))
    smoke = report.check("smoke")
    assert not smoke.passed and "longer than the 0.3 s per-call limit" in smoke.detail, smoke.detail
    assert all(not c.detail.startswith("stopped while running") for c in report.checks)
    await assert_healthy(pool)


async def test_validation_stopped_by_the_service_names_the_check(pool: SandboxPool) -> None:
    # Each call stays under its limit, but all of them outlast the validation's wall clock (4 s here).
    code = inject(GOOD, "step", "import time; time.sleep(0.3)\n")
    report = await pool.validate(code, "game", CheckConfig(call_time_limit_s=1.0))
    assert not report.valid
    stopped = [c for c in report.checks if c.detail.startswith("stopped while running")]
    assert len(stopped) == 1 and "wall-clock limit of 4 s" in stopped[0].detail, report.checks
    later = CHECK_NAMES[CHECK_NAMES.index(stopped[0].name) + 1 :]
    assert all(report.check(name).detail.startswith("not run") for name in later)
    await assert_healthy(pool)
