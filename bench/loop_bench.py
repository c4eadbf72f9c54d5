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
- the overlap (``overlap_learner``, on by default): the seconds of the learner's step that ran beside
  the next step's generation (``time/learner_overlapped_s``, outside the step's wall time, whose
  ``learner`` phase is what the loop still waited for) and how long its publication was held until that
  generation was done;
- rates: generated tokens per second of busy generation time and of the phase's wall time, plays per
  second of the rollout phase, and the inference server's share of the step: its own busy time
  (``time/inference_busy_s``: scheduler time with work, split into prefill and decode) and the
  request-seconds of generation (overlapping requests add up, so this can pass 100 %).

The first step pays one-off costs (model load is before it; the Vendi embedding model loads at the
first stats), so the figures of the last step are the steady state.

``--mode distributed`` breaks down a distributed step instead: the deployment of
``deploy/spade.env`` + ``deploy/local.env`` brought up by ``spade cluster up`` (its own ports, run
directory, database and queue prefix, on this machine's Redis and Postgres, as the e2e tests do;
``tests/e2e/cluster_harness.py``), where the roles run at the same time. A step there is the time
from one ``learner_step`` log line to the next; at each line the bench reads every server's
``/metrics`` and reports what grew in between:

- the learner's parts, one after another, from its step line (``time/*_s``): ``wait`` (for enough
  samples: the share of the step the learner waits on the rollout), ``assemble``, ``train``,
  ``weights``, ``checkpoint``, ``publish`` (until the servers acknowledged the new weights);
- the inference server's busy time (scheduler time with work: its share of the step says how much
  of the step everyone else waited on something other than generation), prefill and decode time,
  tokens generated per second, prompt tokens computed and reused, the mean decode batch, and the
  request-seconds of ``/generate`` per tenant (designer, rollout) from its latency histogram;
- the sandbox's and the memory's busy time and calls per operation;
- plays (the rollout workers' ``play`` lines) and designer attempts by outcome in the step.

Usage::

    .venv/bin/python bench/loop_bench.py [--steps 2] [--envs 1] [--group-size 4]
        [--mode embedded|distributed|both] [--weights float32|bf16|int8|int4] [--designer-init warm|base]
        [--no-overlap] [--json]

``--json`` prints one object (settings, ``os.getloadavg()`` at start and end, each step's breakdown
under ``embedded`` and ``distributed``). ``--steps`` is the learner steps to see in each mode; the
first distributed one is measured from the end of ``up`` (the model loads, the designer's first
round), the later ones are the steady state. ``--run-dir`` keeps the cluster's run directory
(logs, checkpoints) there.
Not a test: nothing is asserted. On a shared machine the load average says how much the figures
are the machine's rather than the code's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, get_args

from services.embedded.metrics import WALL_PHASES
from services.inference.settings import WeightsMode

COMPONENTS = {
    "designer": ("designer_generation", "validation", "designer_memory"),
    "rollout": ("rollout_generation", "sandbox", "rollout_memory"),
    "learner": ("learner_train", "publish_reload"),
}


def breakdown(record: dict[str, Any]) -> dict[str, Any]:
    """One step's phases, components, shares and rates from its ``metrics.jsonl`` line."""
    t = {k.removeprefix("time/").removesuffix("_s"): v for k, v in record.items() if k.startswith("time/")}
    work = {k.removeprefix("work/"): v for k, v in record.items() if k.startswith("work/")}
    wall = sum(t.get(p, 0.0) for p in WALL_PHASES)
    phases = {p: {"wall_s": t[p], "share": t[p] / wall if wall else None} for p in WALL_PHASES if p in t}
    for phase, parts in COMPONENTS.items():
        if phase not in phases:
            continue
        inside: dict[str, Any] = {}
        for part in parts:
            busy = t.get(part) if part == "learner_train" else t.get(f"{part}_busy")
            if busy is None:
                continue
            # An overlapped learner's parts ran mostly outside its phase (what the loop waited for): no share.
            shared = bool(t[phase]) and not (phase == "learner" and t.get("learner_overlapped"))
            inside[part] = {"busy_s": busy, "of_phase": busy / t[phase] if shared else None}
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
    requests = t.get("designer_generation_busy", 0.0) + t.get("rollout_generation_busy", 0.0)
    rates["inference_request_s_share"] = requests / wall if wall else None  # overlapping requests add up
    busy = t.get("inference_busy")  # the server's own busy time (runs before this change lack it)
    rates["inference_busy_share"] = busy / wall if wall and busy is not None else None
    for part in ("prefill", "decode"):
        rates[f"inference_{part}_s"] = t.get(f"inference_{part}")
    # overlap_learner: the learner's step beside the next step's generation (not in the step's wall time)
    overlap = {"learner_overlapped_s": t.get("learner_overlapped"), "publish_held_s": t.get("learner_publish_held")}
    return {"step": record["step"], "wall_s": wall, "phases": phases, "rates": rates, "overlap": overlap}


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

        def pct(share: float | None) -> str:
            return _fmt(100 * share if share is not None else None, "%")

        print(
            f"  rates: rollout {_fmt(r['rollout_tokens_per_s'])} tok/s of the phase "
            f"({_fmt(r['rollout_tokens_per_busy_s'])} per busy s), designer {_fmt(r['designer_tokens_per_s'])} tok/s, "
            f"{_fmt(r['plays_per_s'])} plays/s ({r['plays']} plays)"
        )
        print(
            f"  inference server busy {pct(r['inference_busy_share'])} of the step (prefill "
            f"{_fmt(r['inference_prefill_s'], ' s')}, decode {_fmt(r['inference_decode_s'], ' s')}); "
            f"generation request-seconds {pct(r['inference_request_s_share'])} of the step"
        )
        o = step.get("overlap") or {}
        if o.get("learner_overlapped_s") is not None:
            print(
                f"  overlap: {o['learner_overlapped_s']:.2f} s of the learner's step ran beside the next step's "
                f"generation (not in the step's wall time); its publication held {_fmt(o['publish_held_s'], ' s')} "
                "until that generation was done"
            )


# -- a distributed step: the services as processes (``spade cluster``) ---------------------------------

SCRAPED = {"inference": "SPADE_LOCAL_INFERENCE_PORT", "sandbox": "SPADE_LOCAL_SANDBOX_HTTP_PORT",
           "memory": "SPADE_LOCAL_MEMORY_HTTP_PORT"}  # fmt: skip
"""The servers whose ``/metrics`` are read at every learner step, by the variable naming their HTTP port."""
LEARNER_PARTS = ("wait", "assemble", "train", "weights", "checkpoint", "publish")


def scrape(url: str, key: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """One server's Prometheus samples: (name, sorted labels) → value (``/metrics`` needs a key)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    response = httpx.get(url, timeout=10, headers={"Authorization": f"Bearer {key}"})
    response.raise_for_status()
    text = response.text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _grew(before: dict[Any, float], after: dict[Any, float], name: str, **labels: str) -> dict[str, float]:
    """How much each sample of ``name`` (with ``labels``) grew, keyed by its other labels' values."""
    out: dict[str, float] = {}
    for (sample, sample_labels), value in after.items():
        if sample != name or any(dict(sample_labels).get(k) != v for k, v in labels.items()):
            continue
        rest = ",".join(v for k, v in sample_labels if k not in labels) or "all"
        out[rest] = out.get(rest, 0.0) + value - before.get((sample, sample_labels), 0.0)
    return {k: v for k, v in out.items() if v}


def _events(path: Path, name: str, start: float, end: float) -> list[dict[str, Any]]:
    """The JSON log lines of ``path`` with ``event == name`` logged in ``[start, end)`` (epoch seconds)."""
    import datetime as dt

    found: list[dict[str, Any]] = []
    if not path.exists():
        return found
    for line in path.read_text(errors="replace").splitlines():
        if f'"event": "{name}"' not in line:
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        at = dt.datetime.strptime(record["ts"], "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=dt.UTC).timestamp()
        if start <= at < end:
            found.append(record)
    return found


def distributed_breakdown(
    start: tuple[float, dict[str, Any]], end: tuple[float, dict[str, Any]], step: dict[str, Any], logs: Path
) -> dict[str, Any]:
    """One distributed step: from the scrape at one learner step to the scrape at the next.

    ``start``/``end`` are (epoch seconds, each server's samples); ``step`` is the second learner
    step's metrics (its ``time/*`` parts).
    """
    (t0, before), (t1, after) = start, end
    wall = t1 - t0
    inf0, inf1 = before["inference"], after["inference"]

    def counter(name: str) -> float:
        return _grew(inf0, inf1, f"spade_inference_{name}_total").get("all", 0.0)

    busy = counter("busy_seconds")
    generated = counter("generated_tokens")
    steps = counter("decode_steps")
    learner = {part: step.get(f"time/{part}_s") for part in LEARNER_PARTS if f"time/{part}_s" in step}
    plays = [e for log in sorted(logs.glob("rollout-*.log")) for e in _events(log, "play", t0, t1)]
    attempts = _events(logs / "designer.log", "designer_attempt", t0, t1)
    outcomes: dict[str, int] = {}
    for a in attempts:
        outcomes[str(a.get("outcome"))] = outcomes.get(str(a.get("outcome")), 0) + 1
    per_tenant = _grew(inf0, inf1, "spade_inference_http_seconds_sum", route="/generate")
    calls = _grew(inf0, inf1, "spade_inference_http_seconds_count", route="/generate")
    sandbox_s = _grew(before["sandbox"], after["sandbox"], "spade_sandbox_latency_seconds_sum")
    sandbox_n = _grew(before["sandbox"], after["sandbox"], "spade_sandbox_latency_seconds_count")
    memory_s = _grew(before["memory"], after["memory"], "spade_memory_grpc_seconds_sum")
    memory_n = _grew(before["memory"], after["memory"], "spade_memory_grpc_seconds_count")
    reload = _grew(inf0, inf1, "spade_inference_http_seconds_sum", route="/update_weights_from_disk")
    return {
        "version": int(step.get("version", 0)),
        "wall_s": wall,
        "learner": {
            part: {"wall_s": s, "share": s / wall if wall else None} for part, s in learner.items() if s is not None
        },
        "inference": {
            "busy_s": busy,
            "busy_share": busy / wall if wall else None,
            "prefill_s": counter("prefill_seconds"),
            "decode_s": counter("decode_seconds"),
            "generated_tokens": generated,
            "tokens_per_s": generated / wall if wall else None,
            "tokens_per_busy_s": generated / busy if busy else None,
            "prompt_tokens_computed": counter("prompt_tokens"),
            "prompt_tokens_cached": counter("cached_tokens"),
            "mean_decode_batch": counter("decode_rows") / steps if steps else None,
            "generate_request_s_by_tenant": per_tenant,
            "generate_calls_by_tenant": calls,
            "reload_s": sum(reload.values()),
        },
        "sandbox": {op: {"busy_s": s, "calls": sandbox_n.get(op, 0)} for op, s in sandbox_s.items()},
        "memory": {m: {"busy_s": s, "calls": memory_n.get(m, 0)} for m, s in memory_s.items()},
        "rollout": {"plays": len(plays), "plays_per_s": len(plays) / wall if wall else None},
        "designer": {"attempts": len(attempts), "outcomes": outcomes},
    }


def run_distributed(args: argparse.Namespace) -> dict[str, Any]:
    """Bring the cluster up (``spade cluster up``), read every server's metrics at each learner step."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.e2e.cluster_harness import running_cluster

    # A SIGTERM (or Ctrl-C) still runs `spade cluster down` and drops the cluster's database and keys.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with contextlib.ExitStack() as stack:
        root = Path(args.run_dir) if args.run_dir else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        cluster = stack.enter_context(running_cluster(root))
        urls = {name: f"http://127.0.0.1:{cluster.environ[var]}/metrics" for name, var in SCRAPED.items()}
        started = time.time()
        cluster.up()
        key = cluster.runner.keys()["SPADE_CLUSTER_OPERATOR_KEY"]  # a key every server knows
        # (time, every server's samples, the learner step's metrics): the first when `up` is done
        marks: list[tuple[float, dict[str, Any], dict[str, Any]]] = [
            (time.time(), {n: scrape(u, key) for n, u in urls.items()}, {})
        ]
        log = cluster.runner.log_dir / "learner.log"
        seen = 0
        deadline = time.monotonic() + args.distributed_timeout
        while len(marks) <= args.steps:
            cluster.check_alive()
            if time.monotonic() > deadline:
                raise SystemExit(
                    f"only {len(marks) - 1} learner steps in {args.distributed_timeout} s:\n{cluster.logs()}"
                )
            lines = log.read_text(errors="replace").splitlines() if log.exists() else []
            for line in lines[seen:]:
                if '"event": "learner_step"' in line:
                    metrics = json.loads(json.loads(line)["message"].partition(" ")[2])
                    marks.append((time.time(), {n: scrape(u, key) for n, u in urls.items()}, metrics))
            seen = len(lines)
            time.sleep(0.5)
        steps = [
            distributed_breakdown((a[0], a[1]), (b[0], b[1]), b[2], cluster.runner.log_dir)
            for a, b in itertools.pairwise(marks)
        ]
        return {
            "up_s": marks[0][0] - started,
            "run_dir": str(cluster.runner.run_dir) if args.run_dir else None,
            "steps": steps,
        }


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
        designer_init=args.designer_init,
        inference={"weights": args.weights},
        overlap_learner=not args.no_overlap,
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
                    "overlap_learner",
                    "designer_max_new_tokens",
                    "group_size",
                    "agent_max_turns",
                    "agent_max_tokens_per_turn",
                    "designer_init",
                }
            )
        ),
        "inference_weights": args.weights,
        "run_dir": str(run_dir),
        "total_s": time.perf_counter() - start,
        "steps": steps,
    }


def print_distributed(result: dict[str, Any]) -> None:
    print(f"\ndistributed: `spade cluster up` took {result['up_s']:.0f} s")
    for index, step in enumerate(result["steps"]):
        since = "from `up` to the first learner step" if index == 0 else "from one learner step to the next"
        print(f"\nstep to version {step['version']}: {step['wall_s']:.1f} s ({since})")
        print("  learner, part after part:")
        for part, info in step["learner"].items():
            print(f"    {part:<11} {info['wall_s']:8.2f} s  {_fmt(100 * (info['share'] or 0), '%'):>7}")
        i = step["inference"]
        print(
            f"  inference: busy {i['busy_s']:.1f} s ({_fmt(100 * (i['busy_share'] or 0), '%')} of the step; "
            f"prefill {i['prefill_s']:.1f} s, decode {i['decode_s']:.1f} s), {i['generated_tokens']:.0f} tokens "
            f"({_fmt(i['tokens_per_s'])} tok/s, {_fmt(i['tokens_per_busy_s'])} per busy s), mean decode batch "
            f"{_fmt(i['mean_decode_batch'])}, prompt tokens computed {i['prompt_tokens_computed']:.0f} / cached "
            f"{i['prompt_tokens_cached']:.0f}, weight reload {i['reload_s']:.2f} s"
        )
        for tenant, seconds in sorted(i["generate_request_s_by_tenant"].items()):
            calls = i["generate_calls_by_tenant"].get(tenant, 0)
            print(f"    /generate for {tenant or '(no key)':<10} {seconds:8.1f} request-s  {calls:.0f} calls")
        for service in ("sandbox", "memory"):
            parts = sorted(step[service].items(), key=lambda kv: -kv[1]["busy_s"])
            shown = ", ".join(f"{name} {v['busy_s']:.2f} s/{v['calls']:.0f}" for name, v in parts[:6])
            print(f"  {service}: {shown or '–'}")
        r, d = step["rollout"], step["designer"]
        plays = f"{r['plays']} plays ({_fmt(r['plays_per_s'])} plays/s)"
        print(f"  rollout: {plays}; designer: {d['attempts']} attempts {d['outcomes']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2, help="learner steps (the last one is the steady state)")
    parser.add_argument("--envs", type=int, default=1, help="designer envs per round")
    parser.add_argument("--attempts", type=int, default=1, help="designer attempts per slot")
    parser.add_argument("--designer-tokens", type=int, default=256, help="designer tokens per attempt")
    parser.add_argument("--group-size", type=int, default=4, help="G: seeds per env and arm")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument(
        "--weights",
        choices=get_args(WeightsMode),
        default="float32",
        help="the embedded inference server's weights (SPADE_INFERENCE_WEIGHTS; docs/inference.md)",
    )
    parser.add_argument(
        "--designer-init",
        choices=("warm", "base"),
        default="warm",
        help="the policy the run starts from (base skips building the warm start on a fresh machine)",
    )
    parser.add_argument(
        "--no-overlap",
        action="store_true",
        help="train each step before the next one generates (overlap_learner off: the breakdown before the overlap)",
    )
    parser.add_argument("--run-dir", default=None, help="keep the run here (default: a temporary directory)")
    parser.add_argument(
        "--mode",
        choices=("embedded", "distributed", "both"),
        default="embedded",
        help="the embedded run (in this process), the distributed one (`spade cluster up`), or both",
    )
    parser.add_argument(
        "--distributed-timeout", type=float, default=1800, help="seconds the distributed run may take for --steps"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object with every figure")
    args = parser.parse_args()
    load_start = os.getloadavg()
    result: dict[str, Any] = {"benchmark": "loop", "loadavg_start": list(load_start)}
    if args.mode in ("embedded", "both"):
        result["embedded"] = asyncio.run(main_async(args))
    if args.mode in ("distributed", "both"):
        result["distributed"] = run_distributed(args)
    result["loadavg_end"] = list(os.getloadavg())
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"loop bench: load average {load_start[0]:.1f} at start, {result['loadavg_end'][0]:.1f} at end")
    if "embedded" in result:
        print_table(result["embedded"]["steps"])
    if "distributed" in result:
        print_distributed(result["distributed"])


if __name__ == "__main__":
    main()
