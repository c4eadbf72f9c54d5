"""Sandbox speed: session start, step round trip, steps/s and execute latency, against a fresh
``python3`` subprocess per call (the baseline), measured in the same run.

    .venv/bin/python bench/sandbox_bench.py [--sessions 40] [--steps 400] [--executions 40]

Prints p50/p99 in milliseconds and the baseline/sandbox ratio of p50s. Not a test: nothing is
asserted (machines are shared and noisy); the targets are in docs/sandbox-isolation.md.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

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


def line(name: str, samples: list[float]) -> str:
    return f"{name:<34} p50 {pct(samples, 0.5):8.2f} ms   p99 {pct(samples, 0.99):8.2f} ms   (n={len(samples)})"


async def timed(coro_factory, n: int) -> list[float]:  # type: ignore[no-untyped-def]
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        await coro_factory()
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


async def main(args: argparse.Namespace) -> None:
    config = CheckConfig()
    async with SandboxPool(IsolationSettings()) as pool:
        # Warm-up: first forks fault in the zygote's pages.
        for _ in range(5):
            await (await pool.open_session(ENV.code, "game", 1, config)).close()
            await pool.execute("pass")

        async def start_session() -> None:
            session = await pool.open_session(ENV.code, "game", 1, config)
            assert session.initial.outcome.value == "ok"
            # Closing is part of a session's life but not of its start: close off the clock.
            closing.append(session)

        closing: list = []
        cold_samples = await timed(start_session, args.sessions)
        # The usual life of an env: validated once, then played many times (the repairs are skipped).
        report = await pool.validate(ENV.code, "game", config)
        assert report.valid
        start_samples = await timed(start_session, args.sessions)
        for session in closing:
            await session.close()

        step_samples: list[float] = []
        session = await pool.open_session(ENV.code, "game", 1, config)
        wall = time.perf_counter()
        while len(step_samples) < args.steps:
            start = time.perf_counter()
            outcome = await session.step(ACTION)
            step_samples.append((time.perf_counter() - start) * 1000)
            if outcome.terminated or outcome.truncated:
                await session.close()
                session = await pool.open_session(ENV.code, "game", 1, config)
        await session.close()
        steps_per_s = len(step_samples) / (sum(step_samples) / 1000)
        del wall

        exec_samples = await timed(lambda: pool.execute("print(1)"), args.executions)

    root = str(ROOT)
    code = ENV.code.encode()
    base_start = await timed(lambda: fresh_python(BASELINE_RESET.format(root=root), code), args.baseline)
    base_step = await timed(lambda: fresh_python(BASELINE_STEP.format(root=root, action=ACTION), code), args.baseline)
    base_exec = await timed(lambda: fresh_python("print(1)"), args.baseline)

    print("sandbox (isolated zygote, every layer on)")
    print(line("session start, validated env", start_samples))
    print(line("session start, never-seen code", cold_samples))
    print(line("step round trip", step_samples))
    print(f"{'steps/s (one session, sequential)':<34} {steps_per_s:8.0f}")
    print(line("execute print(1)", exec_samples))
    print(f"baseline (fresh {PYTHON} -S per call, no isolation)")
    print(line("session start", base_start))
    print(line("step (fresh process replays reset+step)", base_step))
    print(line("execute print(1)", base_exec))
    base_steps_per_s = 1000 / statistics.mean(base_step)
    print("ratios (baseline p50 / sandbox p50)")
    print(
        f"  session start  {pct(base_start, 0.5) / pct(start_samples, 0.5):6.1f}x (never-seen code: "
        f"{pct(base_start, 0.5) / pct(cold_samples, 0.5):.1f}x)"
    )
    print(f"  step           {pct(base_step, 0.5) / pct(step_samples, 0.5):6.1f}x")
    print(f"  steps/s        {steps_per_s / base_steps_per_s:6.1f}x")
    print(f"  execute        {pct(base_exec, 0.5) / pct(exec_samples, 0.5):6.1f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=40)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--executions", type=int, default=40)
    parser.add_argument("--baseline", type=int, default=20, help="calls per baseline workload")
    asyncio.run(main(parser.parse_args()))
