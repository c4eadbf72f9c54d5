"""Benchmark: do both roles learn, on this machine? (issues 11 and 19)

Two embedded runs of the same budget (``spade run`` on its defaults, ``--steps`` steps), one with
the policy's designer trained on its rewards and one with ``--designer frozen`` (the paper's
frozen-designer baseline: the designer designs, its samples are scored and never trained on), so
the designer's own learning shows as the difference between them. For each run it reports:

- the agent's mean return on held-out environment families before the first step and after the
  last, paired item by item, with the paired bootstrap interval (the run's ``held_out_eval``);
- the designer's validity over the run, with a Wilson 95 % interval over its attempts;
- the mean blend and the mean regret of the designer samples scored per step, and the regret's
  least-squares slope per step with a bootstrap interval over the steps;
- the Vendi score / n of the pool the designer wrote (the memory's ``pool/vendi_per_n``, last step);
- steps trained per role, and wall time.

Usage::

    .venv/bin/python bench/learning_bench.py [--steps 12] [--arms policy,frozen] [--json]

Not a test: nothing is asserted; a budget that shows no gain is reported as it is, with its numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a proportion (95 % by default)."""
    if n == 0:
        return (0.0, 1.0)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def slope(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """The least-squares slope of ``ys`` on ``xs`` (None with fewer than two distinct x)."""
    if len(set(xs)) < 2:
        return None
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)


def slope_interval(xs: Sequence[float], ys: Sequence[float], resamples: int = 2000) -> tuple[float, float] | None:
    """A percentile bootstrap 95 % interval of the slope, resampling (step, value) pairs."""
    pairs = list(zip(xs, ys, strict=True))
    rng = random.Random(0)
    values = []
    for _ in range(resamples):
        sample = [rng.choice(pairs) for _ in pairs]
        s = slope([x for x, _ in sample], [y for _, y in sample])
        if s is not None:
            values.append(s)
    if not values:
        return None
    values.sort()
    return (values[int(0.025 * len(values))], values[int(0.975 * len(values)) - 1])


def summarise(steps: list[dict[str, Any]], held_out: dict[str, float] | None, wall_s: float) -> dict[str, Any]:
    """The figures of one run from its ``metrics.jsonl`` lines."""
    records = [r for r in steps if r.get("step")]
    attempts = sum(int(r.get("designer/attempts") or 0) for r in records)
    valid = sum(int(r.get("designer/valid") or 0) for r in records)
    scored = [r for r in records if r.get("designer/regret_mean") is not None]
    xs = [float(r["step"]) for r in scored]
    regrets = [float(r["designer/regret_mean"]) for r in scored]
    vendi = next((r.get("pool/vendi_per_n") for r in reversed(records) if r.get("pool/vendi_per_n") is not None), None)
    return {
        "held_out": held_out,
        "designer_attempts": attempts,
        "designer_valid": valid,
        "designer_validity": valid / attempts if attempts else None,
        "designer_validity_interval": wilson(valid, attempts),
        "blend_mean_per_step": [r.get("designer/blend_mean") for r in records],
        "regret_mean_per_step": [r.get("designer/regret_mean") for r in records],
        "regret_slope": slope(xs, regrets),
        "regret_slope_interval": slope_interval(xs, regrets) if len(set(xs)) >= 2 else None,
        "advantage_nonzero_per_step": [r.get("designer/advantage_nonzero_frac") for r in records],
        "vendi_per_n": vendi,
        "agent_win_rate_per_step": [r.get("agent/win_rate") for r in records],
        "steps_trained": sum(1 for r in records if r.get("learner/trained")),
        "steps_designer_trained": sum(1 for r in records if r.get("learner/count/designer_trained")),
        "weight_version": records[-1].get("learner/version") if records else None,
        "wall_s": wall_s,
    }


async def one_run(arm: str, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    from services.embedded.runner import run
    from services.embedded.settings import RunSettings

    settings = RunSettings(
        run_dir=work / arm,
        steps=args.steps,
        designer_mode=arm,
        designer_init=args.designer_init,
        lr=args.lr,
        torch_threads=args.threads,
        held_out_eval=True,
        eval_limit=args.eval_items,
    )
    start = time.perf_counter()
    result = await run(settings)
    return summarise(result.steps, result.held_out, time.perf_counter() - start)


def arm_in_child(arm: str, work: Path, argv: Sequence[str]) -> dict[str, Any]:
    """One arm in a process of its own, so every arm starts from the same state: nothing the arm
    before built (a trained model, the allocator's heap, torch's thread pools) is there, and its
    memory is handed back to the machine before the next arm starts."""
    out = work / f"{arm}.json"
    subprocess.run([sys.executable, __file__, *argv, "--one-arm", arm, "--out", str(out)], check=True)
    return dict(json.loads(out.read_text()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12, help="learner steps per run")
    parser.add_argument("--arms", default="policy,frozen", help="designer modes to run, comma-separated")
    parser.add_argument("--designer-init", default="warm", choices=("base", "warm"))
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--eval-items", type=int, default=24, help="held-out items scored before and after")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--work-dir", default=None)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--one-arm", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="learning-bench-"))
    if args.one_arm is not None:
        Path(args.out).write_text(json.dumps(asyncio.run(one_run(args.one_arm, work, args))))
        return
    load_start = os.getloadavg()
    start = time.perf_counter()
    argv = [*sys.argv[1:], "--work-dir", str(work)]  # the options as given (the last --work-dir wins)
    arms = {arm: arm_in_child(arm, work, argv) for arm in args.arms.split(",")}
    result: dict[str, Any] = {
        "benchmark": "learning",
        "work_dir": str(work),
        "loadavg_start": list(load_start),
        "loadavg_end": list(os.getloadavg()),
        "settings": {k: v for k, v in vars(args).items() if k not in ("json", "work_dir")},
        "total_s": time.perf_counter() - start,
        "arms": arms,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(
        f"learning bench: {args.steps} steps per run (load {load_start[0]:.1f} → {result['loadavg_end'][0]:.1f}, "
        f"{result['total_s'] / 60:.1f} min)"
    )
    for arm, r in arms.items():
        h = r["held_out"]
        lo, hi = r["designer_validity_interval"]
        print(f"  designer {arm}: trained {r['steps_trained']} steps ({r['steps_designer_trained']} designer)")
        if h is not None:
            print(
                f"    held-out ({int(h['n'])} paired items): {h['before']:.3f} → {h['after']:.3f}, "
                f"difference {h['mean']:+.3f} [{h['low']:+.3f}, {h['high']:+.3f}]"
            )
        validity = r["designer_validity"]
        print(
            f"    designer validity {validity if validity is None else round(validity, 3)} "
            f"[{lo:.3f}, {hi:.3f}] ({r['designer_valid']}/{r['designer_attempts']})"
        )
        print(
            f"    regret per step {r['regret_mean_per_step']}, slope {r['regret_slope']} {r['regret_slope_interval']}"
        )
        print(f"    blend per step {r['blend_mean_per_step']}; vendi/n {r['vendi_per_n']}")


if __name__ == "__main__":
    main()
