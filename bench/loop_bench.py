"""Benchmark: where one step of the embedded loop spends its time (issue 14).

Runs ``spade run`` (the real model, sandbox, memory, rollout and learner, in this process) for a few
steps and breaks each step down from its ``metrics.jsonl`` line, which the runner fills as it goes:

- phases, one after another (each is the time the other roles wait for it): ``designer`` (a round:
  generation, parsing, repair, validation, dedup, memory, queue), ``rollout`` (plays of new and
  active envs), ``learner`` (assembling the batch, the GRPO step, writing weights and checkpoint,
  publish + reload), ``stats`` (the memory's process metrics and sandbox probes of new envs);
- components inside them, as busy time summed over calls (concurrent calls add up, so a component can
  be busier than its phase is long): ``designer_generation`` and ``rollout_generation`` (requests to
  the inference server), ``validation`` and ``sandbox`` (the sandbox pool: validation runs, play
  sessions and their steps), ``designer_memory`` and ``rollout_memory`` (the memory service),
  ``learner_train`` (the optimiser step), ``publish_reload`` (the server loading the new weights);
  the designer phase's ``other`` is what its components leave: parsing, repair, dedup and queueing
  (concurrent attempts can hide part of it);
- rates: generated tokens per second of busy generation time and of the phase's wall time, plays per
  second of the rollout phase, and the inference server's share of the step (how long it was busy).

The first step pays one-off costs (model load is before it; the Vendi embedding model loads at the
first stats), so the figures of the last step are the steady state. A distributed step (the
services as processes, ``spade cluster up``) is not broken down here yet: its services log their
own phases (``learner_step``, ``play``, designer attempts), and the output says so.

Usage::

    .venv/bin/python bench/loop_bench.py [--steps 2] [--envs 1] [--group-size 4] [--json]

``--json`` prints one object (settings, ``os.getloadavg()`` at start and end, each step's breakdown).
Not a test: nothing is asserted. On a shared machine the load average says how much the figures
are the machine's rather than the code's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

PHASES = ("designer", "rollout", "learner", "stats", "eval")
COMPONENTS = {
    "designer": ("designer_generation", "validation", "designer_memory"),
    "rollout": ("rollout_generation", "sandbox", "rollout_memory"),
    "learner": ("learner_train", "publish_reload"),
}


def breakdown(record: dict[str, Any]) -> dict[str, Any]:
    """One step's phases, components, shares and rates from its ``metrics.jsonl`` line."""
    t = {k.removeprefix("time/").removesuffix("_s"): v for k, v in record.items() if k.startswith("time/")}
    work = {k.removeprefix("work/"): v for k, v in record.items() if k.startswith("work/")}
    wall = sum(t.get(p, 0.0) for p in PHASES)
    phases = {p: {"wall_s": t[p], "share": t[p] / wall if wall else None} for p in PHASES if p in t}
    for phase, parts in COMPONENTS.items():
        if phase not in phases:
            continue
        inside: dict[str, Any] = {}
        for part in parts:
            busy = t.get(part) if part == "learner_train" else t.get(f"{part}_busy")
            if busy is None:
                continue
            inside[part] = {"busy_s": busy, "of_phase": busy / t[phase] if t[phase] else None}
            if f"{part}_calls" in work:
                inside[part]["calls"] = work[f"{part}_calls"]
        if phase == "designer":  # sequential within an attempt: what they leave is parsing, repair, dedup, queue
            covered = sum(v["busy_s"] for v in inside.values())
            inside["other"] = {"busy_s": max(0.0, t[phase] - covered)}
        phases[phase]["components"] = inside
    plays = (record.get("agent/plays") or 0) + (record.get("agent/hinted_plays") or 0)
    rates: dict[str, Any] = {"plays": plays}
    for role, phase in (("designer", "designer"), ("rollout", "rollout")):
        tokens = work.get(f"{role}_generation_tokens", 0)
        busy = t.get(f"{role}_generation_busy", 0.0)
        rates[f"{role}_tokens"] = tokens
        rates[f"{role}_tokens_per_busy_s"] = tokens / busy if busy else None
        rates[f"{role}_tokens_per_s"] = tokens / t[phase] if t.get(phase) else None
    rates["plays_per_s"] = plays / t["rollout"] if t.get("rollout") else None
    inference_busy = t.get("designer_generation_busy", 0.0) + t.get("rollout_generation_busy", 0.0)
    rates["inference_busy_share"] = inference_busy / wall if wall else None
    return {"step": record["step"], "wall_s": wall, "phases": phases, "rates": rates}


def _fmt(value: Any, unit: str = "") -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.2f}{unit}"
    return f"{value}{unit}"


def print_table(steps: list[dict[str, Any]]) -> None:
    for step in steps:
        print(f"\nstep {step['step']}: {step['wall_s']:.1f} s")
        for phase, info in step["phases"].items():
            print(f"  {phase:<9} {info['wall_s']:8.2f} s  {100 * (info['share'] or 0):5.1f}% of the step")
            for part, figures in info.get("components", {}).items():
                share = figures.get("of_phase")
                calls = f"  {int(figures['calls'])} calls" if "calls" in figures else ""
                busy = f"{figures['busy_s']:8.2f} s"
                print(f"    {part:<20} {busy}  {_fmt(100 * share if share is not None else None, '%'):>7}{calls}")
        r = step["rates"]
        print(
            f"  rates: rollout {_fmt(r['rollout_tokens_per_s'])} tok/s of the phase "
            f"({_fmt(r['rollout_tokens_per_busy_s'])} per busy s), designer {_fmt(r['designer_tokens_per_s'])} tok/s, "
            f"{_fmt(r['plays_per_s'])} plays/s ({r['plays']} plays), inference busy "
            f"{_fmt(100 * r['inference_busy_share'] if r['inference_busy_share'] is not None else None, '%')} "
            "of the step"
        )


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    from services.embedded.runner import run
    from services.embedded.settings import RunSettings

    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="loop-bench-"))
    settings = RunSettings(
        run_dir=run_dir,
        steps=args.steps,
        envs_per_step=args.envs,
        designer_attempts=args.attempts,
        designer_max_new_tokens=args.designer_tokens,
        group_size=args.group_size,
        torch_threads=args.threads,
    )
    start = time.perf_counter()
    result = await run(settings)
    steps = [breakdown(r) for r in result.steps if r.get("step")]
    return {
        "settings": json.loads(
            settings.model_dump_json(
                include={
                    "steps",
                    "envs_per_step",
                    "designer_attempts",
                    "designer_max_new_tokens",
                    "group_size",
                    "agent_max_turns",
                    "agent_max_tokens_per_turn",
                }
            )
        ),
        "run_dir": str(run_dir),
        "total_s": time.perf_counter() - start,
        "steps": steps,
        "distributed": "not measured: this bench does not drive `spade cluster` yet (docs/distributed.md "
        "shows how to follow a distributed run's steps in its logs)",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2, help="learner steps (the last one is the steady state)")
    parser.add_argument("--envs", type=int, default=1, help="designer envs per round")
    parser.add_argument("--attempts", type=int, default=1, help="designer attempts per slot")
    parser.add_argument("--designer-tokens", type=int, default=256, help="designer tokens per attempt")
    parser.add_argument("--group-size", type=int, default=4, help="G: seeds per env and arm")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--run-dir", default=None, help="keep the run here (default: a temporary directory)")
    parser.add_argument("--json", action="store_true", help="print one JSON object with every figure")
    args = parser.parse_args()
    load_start = os.getloadavg()
    result = asyncio.run(main_async(args))
    result = {"benchmark": "loop", "loadavg_start": list(load_start), "loadavg_end": list(os.getloadavg()), **result}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"loop bench: load average {load_start[0]:.1f} at start, {result['loadavg_end'][0]:.1f} at end")
    print_table(result["steps"])
    print(f"\ndistributed step: {result['distributed']}")


if __name__ == "__main__":
    main()
