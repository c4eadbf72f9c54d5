"""Benchmark: does training help, on this machine? (issue 11)

The agent alone (``spade run --designer off --pool``, the fixed-environment baseline) trains on one
seed-pool environment for a fixed number of steps, with the default model on CPU. Its win rate on
held-out seeds of that environment is measured before and after through ``services/eval``'s ``pool``
suite (the same items, paired), and the difference is reported with a paired bootstrap interval
(``spade eval compare``). The same comparison is then made with the ``spade eval --suite pool``
command itself, over every seed-pool environment of the setting (how much of a gain carries over to
the other environments).

Usage::

    .venv/bin/python bench/learning_bench.py [--env number_hunt] [--steps 8] [--group-size 8]
                                             [--seeds 32] [--lr 1e-5] [--json]

``--json`` prints one object (settings, load average, before/after means, the paired differences
with their intervals, wall times). Not a test: nothing is asserted, and a budget that shows no gain
is reported as it is, with its numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def write_pools(directory: Path, env: str, setting: str) -> tuple[Path, Path]:
    """The training pool (one env, as a designer answer file) and the seed pool's export (JSONL)."""
    from spade.envs.examples import EXAMPLES
    from spade.inference.answer_format import designer_answer

    example = EXAMPLES[env]
    train = directory / "train-pool"
    train.mkdir(parents=True)
    (train / f"{env}.md").write_text(f"# skill: {example.skill}\n{designer_answer(example.code, example.hint)}\n")
    every = directory / "seed-pool.jsonl"
    with every.open("w") as fh:
        for name, ex in sorted(EXAMPLES.items()):
            if str(ex.setting) == setting:
                row = {"env_id": name, "setting": setting, "skill": ex.skill, "status": "valid", "code": ex.code}
                fh.write(json.dumps({**row, "hint": ex.hint}) + "\n")
    one = directory / "train-env.jsonl"
    one.write_text(
        json.dumps({"env_id": env, "setting": setting, "skill": example.skill, "status": "valid", "code": example.code})
        + "\n"
    )
    return train, one


async def held_out(model: str | None, pool: Path, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The pool suite on ``pool`` with ``model`` (None: the base model), ``args.seeds`` held-out seeds per env."""
    from services.eval.settings import EvalSettings
    from services.eval.wiring import EvalRequest, run_eval

    settings = EvalSettings(
        temperature=args.temperature,
        concurrency=4,
        torch_threads=args.threads,
        pool={
            "setting": args.setting,
            "seeds_per_env": args.seeds,
            "max_turns": args.turns,
            "max_tokens_per_turn": args.tokens_per_turn,
        },
    )
    request = EvalRequest(suite="pool", model=model, seed=args.eval_seed, limit=None, out=out)
    start = time.perf_counter()
    outcome = await run_eval(request, settings, pool_source=str(pool))
    overall = outcome.summary.categories["overall"]
    return {
        "mean": overall.mean,
        "low": overall.low,
        "high": overall.high,
        "n": overall.n,
        "wall_s": time.perf_counter() - start,
    }


def paired(a: Path, b: Path) -> dict[str, Any]:
    """``b - a`` over the items of both runs, with the paired bootstrap interval."""
    from services.eval.core.compare import compare
    from services.eval.store import read_run

    result = compare(read_run(a), read_run(b))
    iv = result.differences["overall"]
    mean_a, mean_b = result.means["overall"]
    return {
        "paired": result.paired,
        "before": mean_a,
        "after": mean_b,
        "difference": iv.mean,
        "low": iv.low,
        "high": iv.high,
    }


def eval_command(model: str | None, pool: Path, out: Path, args: argparse.Namespace) -> float:
    """``spade eval --suite pool`` as a user runs it; returns its wall time."""
    command = [
        str(Path(sys.executable).parent / "spade"),
        "eval",
        "--suite",
        "pool",
        "--pool",
        str(pool),
        "--seed",
        str(args.eval_seed),
        "--out",
        str(out),
        "--json",
    ]
    if model is not None:
        command += ["--model", model]
    env = {
        **os.environ,
        "SPADE_EVAL_POOL__SEEDS_PER_ENV": str(args.transfer_seeds),
        "SPADE_EVAL_POOL__MAX_TURNS": str(args.turns),
        "SPADE_EVAL_POOL__MAX_TOKENS_PER_TURN": str(args.tokens_per_turn),
        "SPADE_EVAL_TEMPERATURE": str(args.temperature),
        "SPADE_EVAL_POOL__SETTING": args.setting,
    }
    start = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"spade eval failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    return time.perf_counter() - start


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    from services.embedded.runner import run
    from services.embedded.settings import RunSettings

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="learning-bench-"))
    train_pool, one_env = write_pools(work, args.env, args.setting)
    result: dict[str, Any] = {"work_dir": str(work)}

    result["before"] = await held_out(None, one_env, work / "eval-before", args)
    settings = RunSettings(
        run_dir=work / "run",
        setting=args.setting,
        steps=args.steps,
        designer_mode="off",
        pool=train_pool,
        seed_pool=False,
        group_size=args.group_size,
        agent_max_turns=args.turns,
        agent_max_tokens_per_turn=args.tokens_per_turn,
        temperature=args.temperature,
        lr=args.lr,
        torch_threads=args.threads,
    )
    start = time.perf_counter()
    trained = await run(settings)
    result["train"] = {
        "wall_s": time.perf_counter() - start,
        "steps": args.steps,
        "train_win_rate": [r.get("agent/win_rate") for r in trained.steps],
        "trained_steps": sum(1 for r in trained.steps if r.get("learner/trained")),
    }
    checkpoint = str(trained.checkpoint) if trained.checkpoint is not None else None
    result["after"] = await held_out(checkpoint, one_env, work / "eval-after", args)
    result["held_out"] = paired(work / "eval-before", work / "eval-after")

    if not args.skip_transfer:
        wall_before = eval_command(None, work / "seed-pool.jsonl", work / "transfer-before", args)
        wall_after = eval_command(checkpoint, work / "seed-pool.jsonl", work / "transfer-after", args)
        result["transfer"] = {
            **paired(work / "transfer-before", work / "transfer-after"),
            "wall_s": wall_before + wall_after,
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env", default="number_hunt", help="the seed-pool env to train on")
    parser.add_argument("--setting", default="game", choices=("game", "tool"))
    parser.add_argument("--steps", type=int, default=8, help="learner steps")
    parser.add_argument("--group-size", type=int, default=8, help="G: plays per env and version (each arm)")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--turns", type=int, default=3, help="agent turns per play")
    parser.add_argument("--tokens-per-turn", type=int, default=48)
    parser.add_argument("--seeds", type=int, default=32, help="held-out seeds of the trained env")
    parser.add_argument("--transfer-seeds", type=int, default=4, help="held-out seeds per env of the whole pool")
    parser.add_argument("--eval-seed", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--skip-transfer", action="store_true", help="only the trained env's held-out seeds")
    parser.add_argument("--work-dir", default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    load_start = os.getloadavg()
    start = time.perf_counter()
    result = asyncio.run(main_async(args))
    result = {
        "benchmark": "learning",
        "loadavg_start": list(load_start),
        "loadavg_end": list(os.getloadavg()),
        "settings": {k: v for k, v in vars(args).items() if k not in ("json", "work_dir")},
        "total_s": time.perf_counter() - start,
        **result,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    h = result["held_out"]
    print(
        f"learning bench: {args.env}, {args.steps} steps of G={args.group_size}, lr {args.lr} "
        f"(load {load_start[0]:.1f} → {result['loadavg_end'][0]:.1f}, {result['total_s'] / 60:.1f} min)"
    )
    print(f"  training win rate per step: {result['train']['train_win_rate']}")
    print(
        f"  held-out seeds ({h['paired']}): {h['before']:.3f} → {h['after']:.3f}, "
        f"difference {h['difference']:+.3f} [{h['low']:+.3f}, {h['high']:+.3f}] (paired bootstrap 95%)"
    )
    if "transfer" in result:
        t = result["transfer"]
        print(
            f"  spade eval --suite pool, every seed env ({t['paired']} items): {t['before']:.3f} → "
            f"{t['after']:.3f}, difference {t['difference']:+.3f} [{t['low']:+.3f}, {t['high']:+.3f}]"
        )


if __name__ == "__main__":
    main()
