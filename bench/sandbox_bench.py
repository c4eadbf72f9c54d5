"""Sandbox speed against baselines measured in the same run (issue 14's targets).

    .venv/bin/python bench/sandbox_bench.py [--sessions 40] [--steps 400] [--executions 40] [--json]

- one-shot ``execute`` of ``print(1)`` against a fresh ``python3 -S -c 'print(1)'`` per call
  (target: the sandbox at least 5x faster);
- session start for never-seen code (every start a different source, so nothing is cached; target:
  p50 <= 3 ms) and for code the pool has validated;
- step round trip against the machine's pipe ping-pong: two processes bouncing a 64-byte message over
  a pair of pipes (target: within 5x);
- steps/s of one session, and the fresh-interpreter baselines of a session start and a step.

Prints p50/p99 in milliseconds and the ratios; ``--json`` prints one object instead (figures,
baseline figures, ratios, the load average at start). Not a test: nothing is asserted (machines are
shared and noisy); measure when ``uptime`` shows a quiet machine, or report the load with the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
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
    out: dict[str, Any] = {"sandbox": {}, "baseline": {}, "ratios": {}}
    async with SandboxPool(IsolationSettings(spares=args.spares, cgroup=args.cgroup)) as pool:
        out["cgroup"] = pool.health()["cgroup"]["detail"]
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

        cold = []
        for _ in range(args.sessions):
            cold += await timed(lambda: start(f"{ENV.code}\n# never seen: {next(unique)}\n"), 1)
            await close_all()
        assert (await pool.validate(ENV.code, "game", config)).valid
        warm = []
        for _ in range(args.sessions):
            warm += await timed(lambda: start(ENV.code), 1)
            await close_all()

        steps: list[float] = []
        session = await pool.open_session(ENV.code, "game", 1, config)
        while len(steps) < args.steps:
            begin = time.perf_counter()
            outcome = await session.step(ACTION)
            steps.append((time.perf_counter() - begin) * 1000)
            if outcome.terminated or outcome.truncated:
                await session.close()
                session = await pool.open_session(ENV.code, "game", 1, config)
        await session.close()

        executions = await timed(lambda: pool.execute("print(1)"), args.executions)

    ping = pipe_ping_pong(args.steps)
    root = str(ROOT)
    code = ENV.code.encode()
    base_start = await timed(lambda: fresh_python(BASELINE_RESET.format(root=root), code), args.baseline)
    base_step = await timed(lambda: fresh_python(BASELINE_STEP.format(root=root, action=ACTION), code), args.baseline)
    base_exec = await timed(lambda: fresh_python("print(1)"), args.baseline)

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
    ratios["execute_speedup"] = round(pct(base_exec, 0.5) / pct(executions, 0.5), 2)
    ratios["step_over_ping_pong"] = round(pct(steps, 0.5) / pct(ping, 0.5), 2)
    ratios["session_start_speedup_never_seen"] = round(pct(base_start, 0.5) / pct(cold, 0.5), 2)
    ratios["session_start_speedup_validated"] = round(pct(base_start, 0.5) / pct(warm, 0.5), 2)
    ratios["steps_per_s_speedup"] = round(sandbox["steps_per_s"] / (1000 / statistics.mean(base_step)), 1)
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
