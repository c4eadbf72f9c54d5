"""The pool's request paths, end to end through real jails: execute, sessions, validation, faults."""

from __future__ import annotations

import asyncio
import errno
import os
import signal

import pytest

from services.sandbox.isolation import ExecStatus, IsolationSettings, SandboxFault, SandboxPool
from spade.envs import CheckConfig, Outcome
from spade.envs.examples import EXAMPLES
from spade.envs.repair import repair_code
from tests.unit.envs.sample_envs import GUESS_GAME

pytestmark = pytest.mark.sandbox


async def test_execute_stdin_files_argv_and_exit_codes() -> None:
    async with SandboxPool(IsolationSettings()) as pool:
        program = (
            "import sys\n"
            "data = sys.stdin.read()\n"
            "print(sys.argv, open('in/data.txt').read(), data.upper())\n"
            "print('warn', file=sys.stderr)\n"
            "sys.exit(3)\n"
        )
        result = await pool.execute(program, stdin=b"hello", files={"in/data.txt": b"file!"})
        assert result.status is ExecStatus.ERROR and result.exit_code == 3
        assert result.stdout == b"['main.py'] file! HELLO\n" and result.stderr == b"warn\n"
        crashed = await pool.execute("def f():\n    raise ValueError('boom')\nf()\n")
        assert crashed.status is ExecStatus.ERROR and crashed.exit_code == 1
        assert crashed.stderr.startswith(b"Traceback") and b"ValueError: boom" in crashed.stderr
        assert b"worker.py" not in crashed.stderr  # the runtime's own frames are not shown
        big_stdin = await pool.execute("import sys; print(len(sys.stdin.buffer.read()))", stdin=b"x" * (3 << 20))
        assert big_stdin.stdout == b"3145728\n"
        ignored = await pool.execute("print('no stdin read')", stdin=b"y" * (3 << 20))
        assert ignored.status is ExecStatus.OK
        no_stdin = await pool.execute("import sys; print(repr(sys.stdin.read()))", timeout_s=5)
        assert (no_stdin.status, no_stdin.stdout) == (ExecStatus.OK, b"''\n")  # end of file at once
        with pytest.raises(ValueError, match="timeout_s=999"):
            await pool.execute("pass", timeout_s=999)


async def test_sessions_play_an_example_to_a_win() -> None:
    example = EXAMPLES["counterfeit_coin"]
    async with SandboxPool(IsolationSettings()) as pool:
        # The winning moves come from the env itself, replayed outside the sandbox with the same seed.
        from spade.envs import EnvSession

        local = EnvSession(example.code, "game", 7)
        local.reset()
        moves = local.env.solution()
        session = await pool.open_session(example.code, "game", 7, CheckConfig())
        assert session.initial.outcome is Outcome.OK and session.initial.turn == 0
        for move in moves:
            outcome = await session.step(move)
        assert outcome.terminated and outcome.reward == 1.0
        await session.close()
        await session.close()  # idempotent
        assert pool.health()["sessions"] == 0


async def test_every_execution_seeds_random_afresh() -> None:
    # The zygote has imported random (the env library uses it); a program's process is forked with
    # os.fork, whose hooks reseed it, so no two programs draw the same numbers.
    async with SandboxPool(IsolationSettings()) as pool:
        draws = [await pool.execute("import random; print(random.getrandbits(64))") for _ in range(3)]
    assert all(d.status is ExecStatus.OK for d in draws)
    assert len({d.stdout for d in draws}) == 3, draws


async def test_session_with_broken_code_is_an_env_error() -> None:
    async with SandboxPool(IsolationSettings()) as pool:
        session = await pool.open_session("class Broken(:\n", "game", 0, CheckConfig())
        assert session.initial.outcome is Outcome.ENV_ERROR
        assert not session.alive


async def test_examples_validate_inside_the_sandbox() -> None:
    async with SandboxPool(IsolationSettings()) as pool:
        reports = await asyncio.gather(
            *(pool.validate(e.code, e.setting.value, CheckConfig()) for e in EXAMPLES.values())
        )
    for example, report in zip(EXAMPLES.values(), reports, strict=True):
        assert report.valid, (example.name, report.summary())


async def test_zygote_death_fails_in_flight_requests_and_is_restarted() -> None:
    async with SandboxPool(IsolationSettings()) as pool:
        example = EXAMPLES["code_breaker"]
        session = await pool.open_session(example.code, "game", 1, CheckConfig())
        running = asyncio.create_task(pool.execute("import time; time.sleep(30)", timeout_s=30))
        await asyncio.sleep(0.3)
        zygote_pid = pool.health()["zygotes"][0]["pid"]
        os.killpg(zygote_pid, signal.SIGKILL)
        with pytest.raises(SandboxFault):
            await running
        outcome = await session.step("\\boxed{guess 1 2 3 4}")
        assert outcome.outcome is Outcome.SANDBOX_FAULT
        for _ in range(100):  # restarted without waiting for a request
            if pool.health()["status"] == "ok":
                break
            await asyncio.sleep(0.05)
        assert pool.health()["zygotes"][0]["restarts"] == 1
        result = await pool.execute("print('back')")
        assert result.stdout == b"back\n"
        health = pool.health()
        assert health["zygotes"][0]["restarts"] == 1 and health["status"] == "ok"


NEEDS_REPAIR = """
import random


class EchoNumberEnv:
    max_turns = 3

    def reset(self, seed=None):
        self.rng = random.Random(seed)
        self.n = self.rng.randint(1, 1000)
        self.t = 0
        return f"The number is {self.n}. Reply \\\\boxed{guess N} with it, or \\\\boxed{done} to give up.", {}

    def step(self, action):
        self.t += 1
        if action.strip() == f"\\\\boxed{{guess {self.n}}}":
            return "won", 1.0, True, False, {}
        return "no", 0.0, False, self.t >= self.max_turns, {}

    def solution(self):
        return [f"\\\\boxed{{guess {self.n}}}"]
"""


PARSES_BUT_NEEDS_REPAIR = """
class ReplyEnv:
    max_turns = 2

    def reset(self, seed=None):
        return f"Reply \\\\boxed{done} to finish.", {}

    def step(self, action):
        return "bye", 1.0, True, False, {}

    def solution(self):
        return ["\\\\boxed{done}"]
"""


async def test_sessions_of_never_seen_code_load_what_the_repairs_make_of_it() -> None:
    # The service alone decides: code its cheap test passes goes as it is (the jail does not test it
    # again), and code that parses but would raise (an f-string's \\boxed{done}) is repaired first.
    async with SandboxPool(IsolationSettings()) as pool:
        clean = await pool.open_session(EXAMPLES["code_breaker"].code, "game", 1, CheckConfig())
        assert clean.initial.outcome is Outcome.OK, clean.initial
        assert len(pool.repairs) == 0  # nothing to repair, nothing remembered
        await clean.close()
        fixed = await pool.open_session(PARSES_BUT_NEEDS_REPAIR, "game", 1, CheckConfig())
        assert fixed.initial.outcome is Outcome.OK, fixed.initial
        assert fixed.initial.observation == "Reply \\boxed{done} to finish."
        assert pool.repairs.known(PARSES_BUT_NEEDS_REPAIR) == repair_code(PARSES_BUT_NEEDS_REPAIR)[0]
        await fixed.close()


async def test_sessions_of_validated_code_skip_the_repairs_and_play_the_same() -> None:
    async with SandboxPool(IsolationSettings()) as pool:
        cold = await pool.open_session(NEEDS_REPAIR, "game", 5, CheckConfig())
        assert cold.initial.outcome is Outcome.OK, cold.initial  # the service repaired the f-string
        report = await pool.validate(NEEDS_REPAIR, "game", CheckConfig())
        assert report.valid, report.summary()
        # The repairs are the service's own, the same for validation and sessions.
        assert report.repaired_code == repair_code(NEEDS_REPAIR)[0] != NEEDS_REPAIR
        assert len(pool.repairs) == 2  # the code as sent and as repaired both map to the repaired code
        assert pool.repairs.known(NEEDS_REPAIR) == pool.repairs.known(report.repaired_code) == report.repaired_code
        for code in (NEEDS_REPAIR, report.repaired_code):
            warm = await pool.open_session(code, "game", 5, CheckConfig())
            assert warm.initial.outcome is Outcome.OK, warm.initial
            assert warm.initial.observation == cold.initial.observation
            number = warm.initial.observation.split()[3].rstrip(".")
            won = await warm.step(f"\\boxed{{guess {number}}}")
            assert won.terminated and won.reward == 1.0
            await warm.close()
        await cold.close()


async def test_files_that_cannot_be_written_are_the_callers_error() -> None:
    async with SandboxPool(IsolationSettings(file_size_mb=1)) as pool:
        clash = await pool.execute("print('ran')", files={"a": b"x", "a/b": b"y"})
        assert clash.status is ExecStatus.ERROR and clash.stdout == b""
        assert b"could not write the execution's files" in clash.stderr
        too_big = await pool.execute("print('ran')", files={"big.bin": b"x" * (2 << 20)})
        assert too_big.status is ExecStatus.OUTPUT_LIMIT
        named_main = await pool.execute("print(open('main.py').read())", files={"main.py": b"data"})
        assert named_main.stdout == b"data\n"


async def test_concurrent_requests_never_cross_channels() -> None:
    # Each request's fds travel to the zygote with its own spawn message; under concurrency every
    # program must still read its own stdin and write to its own stdout.
    async with SandboxPool(IsolationSettings(zygotes=2)) as pool:
        tokens = [f"token-{i}".encode() for i in range(16)]
        program = "import sys, os\nsys.stdout.write(sys.stdin.read() + ' ' + str(len(os.listdir('/tmp'))))"
        results = await asyncio.gather(
            *(pool.execute(program, stdin=token, files={f"f{i}": b""}) for i, token in enumerate(tokens))
        )
        assert [r.stdout for r in results] == [token + b" 1" for token in tokens]


# An env that, on reset, puts as many fds in flight as the kernel lets it (SCM_RIGHTS to a socket of
# its own that never reads them) and keeps them there while its session lasts.
FLOODS_FDS = GUESS_GAME.replace(
    "    def reset(self, seed=None):\n",
    "    def reset(self, seed=None):\n"
    "        import socket\n"
    "        self.held = socket.socketpair()\n"
    "        sent = 0\n"
    "        try:\n"
    "            while True:\n"
    "                socket.send_fds(self.held[0], [b'x'], [1] * 250)\n"
    "                sent += 250\n"
    "        except OSError as exc:\n"
    "            return f'{sent} fds in flight, then errno {exc.errno}', {}\n",
)


async def test_fds_one_jails_program_keeps_in_flight_do_not_fail_other_requests() -> None:
    # Every jail runs as the one sandbox uid, and the kernel refuses to pass fds for a process
    # without CAP_SYS_RESOURCE while that uid has more in flight than the sender's RLIMIT_NOFILE
    # (ETOOMANYREFS). Pid 1 of each jail passes the request's channels to its waiter so: one tenant's
    # program holding fds in flight must not make every other request fail.
    settings = IsolationSettings()
    assert settings.open_files < 250  # the flood puts more in flight than a jail's own limit
    async with SandboxPool(settings) as pool:
        flood = await pool.open_session(FLOODS_FDS, "game", 1, CheckConfig())
        assert flood.initial.outcome is Outcome.OK
        assert flood.initial.observation == f"250 fds in flight, then errno {errno.ETOOMANYREFS}"
        result = await pool.execute("print('ran')")
        assert (result.status, result.stdout) == (ExecStatus.OK, b"ran\n"), result.stderr
        session = await pool.open_session(EXAMPLES["counterfeit_coin"].code, "game", 7, CheckConfig())
        assert session.initial.outcome is Outcome.OK, session.initial.observation
        await session.close()
        await flood.close()


async def test_a_cancelled_step_ends_the_session_instead_of_desynchronising_it() -> None:
    slow_step = NEEDS_REPAIR.replace(
        "        self.t += 1\n", "        self.t += 1\n        import time\n        time.sleep(0.5)\n"
    )
    async with SandboxPool(IsolationSettings()) as pool:
        session = await pool.open_session(slow_step, "game", 1, CheckConfig())
        assert session.initial.outcome is Outcome.OK
        step = asyncio.create_task(session.step("\\boxed{guess 1}"))
        await asyncio.sleep(0.1)
        step.cancel()
        with pytest.raises(asyncio.CancelledError):
            await step
        assert not session.alive
        assert pool.health()["sessions"] == 0


async def test_a_cancelled_execution_is_killed_and_the_pool_carries_on() -> None:
    async with SandboxPool(IsolationSettings()) as pool:
        running = asyncio.create_task(pool.execute("import sys, time\nprint('up', flush=True)\ntime.sleep(30)"))
        await asyncio.sleep(0.5)
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
        result = await pool.execute("print('next')")
        assert result.stdout == b"next\n"
