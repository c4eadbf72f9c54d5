"""Sandbox speed against baselines measured in the same run (issue 14's targets).

    .venv/bin/python bench/sandbox_bench.py [--sessions 40] [--steps 400] [--executions 40] [--json]

- one-shot ``execute`` of ``print(1)`` against a fresh ``python3 -S -c 'print(1)'`` per call
  (target: the sandbox at least 5x faster);
- session start for never-seen code (every start a different source, so nothing is cached; target:
  p50 <= 3 ms) and for code the pool has validated;
- step round trip against the machine's pipe ping-pong: two processes bouncing a 64-byte message over
  a pair of pipes (target: within 5x);
- steps/s of one session, and the fresh-interpreter baselines of a session start and a step;
- a whole validation of a game and of a tool example (every episode it plays is a session);
- floors: what the same work costs with no isolation at all, in the sandbox's interpreter: the env's
  own ``EnvSession.step`` in a warm process, and a process forked per call from a warm interpreter
  that loads never-seen code and resets it, or runs ``print(1)``. No isolation layer can make a
  request cheaper than its floor; the ``*_floor`` ratios say how far the targets are from it.

Also CPU time per call, which a busy machine inflates far less than wall time: the pool's (each
zygote and every jail it has reaped, from ``/proc``: kernel worker threads, such as a network
namespace's teardown, are not counted), the service's (this process), and a fresh interpreter's.

Prints p50/p99 in milliseconds and the ratios; ``--json`` prints one object instead (figures,
baseline figures, CPU per call, ratios, the load average at start). Not a test: nothing is asserted (machines are
shared and noisy); measure when ``uptime`` shows a quiet machine, or report the load with the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.sandbox.isolation import IsolationSettings, SandboxPool  # noqa: E402
from spade.envs import CheckConfig  # noqa: E402
from spade.envs.examples import EXAMPLES  # noqa: E402

ENV = EXAMPLES["code_breaker"]
TOOL_ENV = EXAMPLES["order_desk"]
ACTION = "\\boxed{guess 1 2 3 4}"
PYTHON = "/usr/bin/python3.11"
# The baseline's whole job per call: a fresh interpreter that loads the env and answers one call.
BASELINE_RESET = (
    "import sys; sys.path.insert(0, {root!r}); from spade.envs import EnvSession; "
    "s = EnvSession(sys.stdin.read(), 'game', 1); print(s.reset().to_dict()['turn'])"
)
BASELINE_STEP = (
    "import sys; sys.path.insert(0, {root!r}); from spade.envs import EnvSession; "
    "s = EnvSession(sys.stdin.read(), 'game', 1); s.reset(); print(s.step({action!r}).to_dict()['turn'])"
)
# The floors, run by PYTHON: the sandbox's work with none of its isolation (no namespaces, no jail
# processes, no channels), from a warm interpreter as the zygote is one.
FLOORS = """
import json, os, sys, time
sys.path.insert(0, {root!r})
from spade.envs import CheckConfig, EnvSession
from spade.envs.loader import compile_env, load_env_class

code, action, steps, starts, executions = {code!r}, {action!r}, {steps}, {starts}, {executions}
config = CheckConfig()


def start(source):
    loaded = load_env_class(source, "game", compile_env(source))
    session = EnvSession.from_class(loaded.env_class, "game", 1, config)
    session.reset()
    return session


def forked(work):
    begin = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        work()
        sys.stdout.flush()
        os._exit(0)
    os.waitpid(pid, 0)
    return (time.perf_counter() - begin) * 1000


step = []
session = start(code)
while len(step) < steps:
    if session.done:
        session = start(code)
    begin = time.perf_counter()
    session.step(action)
    step.append((time.perf_counter() - begin) * 1000)
start_forked = [forked(lambda: start(code + "\\n# never seen: %d\\n" % i)) for i in range(starts)]
null = os.open(os.devnull, os.O_WRONLY)
os.dup2(null, 1)
execute_forked = [forked(lambda: exec(compile("print(1)", "main.py", "exec"), {{}})) for _ in range(executions)]
sys.stderr.write(json.dumps({{"env_step": step, "session_start": start_forked, "execute": execute_forked}}))
"""


TICK_MS = 1000 / os.sysconf("SC_CLK_TCK")
SETTLE_S = 0.3
"""Pause before reading the CPU meter, so the jails of the calls just made are reaped."""


def _stat(pid: int) -> list[str]:
    """The fields of ``/proc/PID/stat`` after the command name (the state is [0], utime [11])."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


class CpuMeter:
    """CPU ms of the pool's processes (utime+stime+cutime+cstime of each zygote) and of this one."""

    def __init__(self, pool: SandboxPool) -> None:
        parents = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    parents[int(entry.name)] = int(_stat(int(entry.name))[1])
                except (OSError, IndexError):
                    continue
        launchers = {z["pid"] for z in pool.health()["zygotes"]}
        below: set[int] = set()
        for pid in parents:
            cursor = pid
            while cursor in parents and cursor not in launchers and cursor > 1:
                cursor = parents[cursor]
            if cursor in launchers:
                below.add(pid)
        # A zygote runs the sandbox's python; its parent (bubblewrap) does not.
        self.zygotes = [pid for pid in below if _comm(pid) == Path(PYTHON).name and _comm(parents[pid]) != _comm(pid)]

    def read(self) -> tuple[float, float]:
        pool = sum(sum(int(x) for x in _stat(pid)[11:15]) for pid in self.zygotes) * TICK_MS
        return pool, time.process_time() * 1000


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


async def metered(meter: CpuMeter, calls: int, body: Callable[[], Awaitable[Any]]) -> dict[str, float]:
    """Run ``body`` (``calls`` calls); the pool's and the service's CPU ms per call."""
    pool0, service0 = meter.read()
    await body()
    await asyncio.sleep(SETTLE_S)
    pool1, service1 = meter.read()
    return {"pool": round((pool1 - pool0) / calls, 3), "service": round((service1 - service0) / calls, 3)}


def children_cpu_ms() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (usage.ru_utime + usage.ru_stime) * 1000


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def figures(samples: list[float]) -> dict[str, float]:
    return {"p50_ms": round(pct(samples, 0.5), 4), "p99_ms": round(pct(samples, 0.99), 4), "n": len(samples)}


async def timed(call: Callable[[], Awaitable[Any]], n: int) -> list[float]:
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        await call()
        samples.append((time.perf_counter() - start) * 1000)
    return samples


async def fresh_python(code: str, stdin: bytes = b"") -> bytes:
    proc = await asyncio.create_subprocess_exec(
        PYTHON, "-S", "-c", code, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
    )
    out, _ = await proc.communicate(stdin)
    if proc.returncode != 0:
        raise RuntimeError(f"baseline subprocess failed with {proc.returncode}")
    return out


async def measure_floors(args: argparse.Namespace) -> dict[str, list[float]]:
    """Run ``FLOORS`` in the sandbox's interpreter; its samples (ms) by name."""
    script = FLOORS.format(
        root=str(ROOT),
        code=ENV.code,
        action=ACTION,
        steps=args.steps,
        starts=args.sessions,
        executions=args.executions,
    )
    proc = await asyncio.create_subprocess_exec(
        PYTHON, "-S", "-c", script, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
    )
    _, err = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"the floors script failed with {proc.returncode}: {err[-500:]!r}")
    samples: dict[str, list[float]] = json.loads(err)
    return samples


def pipe_ping_pong(rounds: int) -> list[float]:
    """Round trips of a 64-byte message between this process and a forked child over two pipes."""
    to_child, from_parent = os.pipe()
    to_parent, from_child = os.pipe()
    message = b"x" * 64
    pid = os.fork()
    if pid == 0:
        try:
            for _ in range(rounds):
                os.write(from_child, os.read(to_child, 64))
        finally:
            os._exit(0)
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        os.write(from_parent, message)
        os.read(to_parent, 64)
        samples.append((time.perf_counter() - start) * 1000)
    os.waitpid(pid, 0)
    for fd in (to_child, from_parent, to_parent, from_child):
        os.close(fd)
    return samples


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    config = CheckConfig()
    unique = itertools.count()
    out: dict[str, Any] = {"sandbox": {}, "baseline": {}, "cpu_ms_per_call": {}, "ratios": {}}
    cpu = out["cpu_ms_per_call"]
    async with SandboxPool(IsolationSettings(spares=args.spares, cgroup=args.cgroup)) as pool:
        out["cgroup"] = pool.health()["cgroup"]["detail"]
        meter = CpuMeter(pool)
        # Warm-up: the first forks fault in the zygote's pages.
        for _ in range(5):
            await (await pool.open_session(ENV.code, "game", 1, config)).close()
            await pool.execute("pass")
        closing: list[Any] = []

        async def start(code: str) -> None:
            session = await pool.open_session(code, "game", 1, config)
            assert session.initial.outcome.value == "ok", session.initial
            closing.append(session)  # closing is part of a session's life, not of its start

        async def close_all() -> None:
            while closing:
                await closing.pop().close()

        cold: list[float] = []
        warm: list[float] = []

        async def starts(samples: list[float], code: Callable[[], str]) -> None:
            for _ in range(args.sessions):
                samples += await timed(lambda: start(code()), 1)
                await close_all()

        cpu["session_start_never_seen"] = await metered(
            meter, args.sessions, lambda: starts(cold, lambda: f"{ENV.code}\n# never seen: {next(unique)}\n")
        )
        assert (await pool.validate(ENV.code, "game", config)).valid
        cpu["session_start_validated"] = await metered(meter, args.sessions, lambda: starts(warm, lambda: ENV.code))

        steps: list[float] = []
        stepping_ms = 0.0  # the service's CPU in steps only (the env's process is reaped with its session)
        session = await pool.open_session(ENV.code, "game", 1, config)
        while len(steps) < args.steps:
            begin, begin_cpu = time.perf_counter(), time.process_time()
            outcome = await session.step(ACTION)
            steps.append((time.perf_counter() - begin) * 1000)
            stepping_ms += (time.process_time() - begin_cpu) * 1000
            if outcome.terminated or outcome.truncated:
                await session.close()
                session = await pool.open_session(ENV.code, "game", 1, config)
        await session.close()
        cpu["step_round_trip"] = {"service": round(stepping_ms / len(steps), 3)}

        executions: list[float] = []

        async def execute() -> None:
            executions.extend(await timed(lambda: pool.execute("print(1)"), args.executions))

        cpu["execute_print_1"] = await metered(meter, args.executions, execute)

        # A whole validation: every episode it plays is a session of its own (validation is
        # indistinguishable from play), so its cost is about (sessions it opens) x a session start.
        for name, example in (("validate_game", ENV), ("validate_tool", TOOL_ENV)):

            async def validate(code: str = example.code, setting: str = example.setting.value) -> None:
                await pool.validate(code, setting, config)

            out["sandbox"][name] = figures(await timed(validate, args.validations))

    ping = pipe_ping_pong(args.steps)
    root = str(ROOT)
    code = ENV.code.encode()
    before = children_cpu_ms()
    base_start = await timed(lambda: fresh_python(BASELINE_RESET.format(root=root), code), args.baseline)
    cpu["fresh_python_session_start"] = round((children_cpu_ms() - before) / args.baseline, 3)
    base_step = await timed(lambda: fresh_python(BASELINE_STEP.format(root=root, action=ACTION), code), args.baseline)
    before = children_cpu_ms()
    base_exec = await timed(lambda: fresh_python("print(1)"), args.baseline)
    cpu["fresh_python_execute"] = round((children_cpu_ms() - before) / args.baseline, 3)
    floors = await measure_floors(args)

    sandbox, baseline, ratios = out["sandbox"], out["baseline"], out["ratios"]
    sandbox["session_start_never_seen"] = figures(cold)
    sandbox["session_start_validated"] = figures(warm)
    sandbox["step_round_trip"] = figures(steps)
    sandbox["steps_per_s"] = round(len(steps) / (sum(steps) / 1000), 1)
    sandbox["execute_print_1"] = figures(executions)
    baseline["pipe_ping_pong"] = figures(ping)
    baseline["fresh_python_session_start"] = figures(base_start)
    baseline["fresh_python_step"] = figures(base_step)
    baseline["fresh_python_execute"] = figures(base_exec)
    baseline["floor_env_step_in_process"] = figures(floors["env_step"])
    baseline["floor_session_start_forked"] = figures(floors["session_start"])
    baseline["floor_execute_forked"] = figures(floors["execute"])
    ratios["execute_speedup"] = round(pct(base_exec, 0.5) / pct(executions, 0.5), 2)
    ratios["step_over_ping_pong"] = round(pct(steps, 0.5) / pct(ping, 0.5), 2)
    ratios["session_start_speedup_never_seen"] = round(pct(base_start, 0.5) / pct(cold, 0.5), 2)
    ratios["session_start_speedup_validated"] = round(pct(base_start, 0.5) / pct(warm, 0.5), 2)
    ratios["steps_per_s_speedup"] = round(sandbox["steps_per_s"] / (1000 / statistics.mean(base_step)), 1)
    # The best each target could be with no isolation at all (a fork per call, the env's own step).
    spent = cpu["execute_print_1"]["pool"] + cpu["execute_print_1"]["service"]
    ratios["execute_cpu_speedup"] = round(cpu["fresh_python_execute"] / spent, 2) if spent else None
    ratios["execute_speedup_floor"] = round(pct(base_exec, 0.5) / pct(floors["execute"], 0.5), 2)
    ratios["step_over_ping_pong_floor"] = round(pct(floors["env_step"], 0.5) / pct(ping, 0.5), 2)
    out["targets"] = {
        "execute_speedup >= 5": ratios["execute_speedup"] >= 5,
        "session_start_never_seen p50 <= 3 ms": sandbox["session_start_never_seen"]["p50_ms"] <= 3.0,
        "step_over_ping_pong <= 5": ratios["step_over_ping_pong"] <= 5,
    }
    return out


def report(out: dict[str, Any]) -> None:
    def line(name: str, f: dict[str, float]) -> str:
        return f"{name:<40} p50 {f['p50_ms']:8.3f} ms   p99 {f['p99_ms']:8.3f} ms   (n={f['n']})"

    print(f"load average at start: {out['load_average']}   cgroup: {out['cgroup']}")
    print("sandbox (isolated zygote, every layer on)")
    for name, value in out["sandbox"].items():
        print(line(name, value) if isinstance(value, dict) else f"{name:<40} {value}")
    print("CPU ms per call (pool: zygotes and reaped jails; service: this process)")
    for name, value in out["cpu_ms_per_call"].items():
        print(f"  {name:<38} {value}")
    print("baselines (same run)")
    for name, value in out["baseline"].items():
        print(line(name, value))
    print("ratios")
    for name, value in out["ratios"].items():
        print(f"  {name:<38} {value}")
    print("targets met: " + ", ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in out["targets"].items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=40)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--executions", type=int, default=40)
    parser.add_argument("--baseline", type=int, default=20, help="calls per baseline workload")
    parser.add_argument("--validations", type=int, default=3, help="validations of a game and of a tool example")
    parser.add_argument("--spares", type=int, default=IsolationSettings().spares, help="spare jails per zygote")
    parser.add_argument(
        "--cgroup",
        choices=["auto", "off"],
        default="auto",
        help="the pool's cgroup (its CPU weight is one process's: on a busy machine 'off' shows the jails "
        "competing as separate processes, as the baseline's interpreters do)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    load = [round(x, 2) for x in os.getloadavg()]
    out = {"load_average": load, **asyncio.run(measure(args))}
    if args.json:
        print(json.dumps(out))
    else:
        report(out)


if __name__ == "__main__":
    main()
