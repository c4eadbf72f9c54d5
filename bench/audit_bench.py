"""Benchmark: how often would the audit retire an honest env, and what does an audit cost?

The rollout's audit plays (``services/rollout/core/audit.py``) retire an env when a trivial policy's
win rate (mean return) over its ``audit_plays`` plays exceeds ``audit_max_win_rate``. Graded envs
pay a random guess partial credit, so with few plays an honest env can be retired by chance. For
every training family (``spade.envs.families``) at a few difficulties and variants this plays each
trivial policy on ``--seeds`` rollout seeds of slot 0 through the audit's own player, then
estimates (by resampling those returns) the chance that the mean over ``n`` plays exceeds the
threshold, for ``n`` = 1..4. The family envs are the repository's own trusted code, so they run
in-process here; ``--cost`` also times one env's audit through the real sandbox pool.

    .venv/bin/python bench/audit_bench.py [--seeds 200] [--threshold 0.5] [--cost] [--json]

Measured on the shared 2-core machine (load 9-10): at worst 26% at n = 1 (``largest``, difficulty
0), 10% at 2, 6% at 3, 3% at 4; the constant action never scored; 8 audit plays through the pool in
0.28 s. Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from typing import Any

from services.rollout.core.audit import AuditPlayer, AuditPolicy
from services.rollout.core.seeds import play_seeds
from spade.agent.ports import EnvSpec
from spade.envs.families import training_families
from spade.envs.loader import load_env_class
from tests.unit.rollout.players import LocalSessions

PLAYS = (1, 2, 3, 4)


async def false_retirements(seeds: int, threshold: float) -> list[dict[str, Any]]:
    rng = random.Random(0)
    rows = []
    for family in training_families("game"):
        for difficulty in (0.0, 0.5, 1.0):
            for variant in (0, 1):
                env = family.generate(difficulty, variant=variant)
                loaded = load_env_class(env.code, env.setting)
                assert loaded.env_class is not None, loaded.problems
                player = AuditPlayer(LocalSessions({env.code: loaded.env_class}), 3)
                spec = EnvSpec(env.name, env.setting, env.skill, env.code, "")
                row: dict[str, Any] = {"env": env.name}
                for policy in AuditPolicy:
                    returns = [
                        (await player.play(spec, seed, policy)).episode_return
                        for seed in play_seeds(env.name, 0, seeds)
                    ]
                    row[f"{policy}_mean"] = round(statistics.mean(returns), 3)
                    for n in PLAYS:
                        hits = sum(statistics.mean(rng.sample(returns, n)) > threshold for _ in range(4000))
                        row[f"{policy}_p_retire_n{n}"] = hits / 4000
                rows.append(row)
    return rows


async def sandbox_cost(plays_per_policy: int) -> float:
    from services.rollout.sandbox import PoolSessions
    from services.sandbox.isolation import IsolationSettings, SandboxPool

    pool = SandboxPool(IsolationSettings())
    await pool.start()
    try:
        env = training_families("game")[0].generate(0.0)
        spec = EnvSpec(env.name, env.setting, env.skill, env.code, "")
        player = AuditPlayer(PoolSessions(pool), 3)
        await player.play(spec, 1, AuditPolicy.NOOP)  # warm the pool
        seeds = play_seeds(env.name, 0, plays_per_policy)
        start = time.perf_counter()
        await asyncio.gather(*(player.play(spec, s, p) for s in seeds for p in AuditPolicy))
        return time.perf_counter() - start
    finally:
        await pool.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=200)
    parser.add_argument("--threshold", type=float, default=0.5)
    parser.add_argument("--cost", action="store_true", help="time one env's 8 audit plays in the sandbox pool")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = asyncio.run(false_retirements(args.seeds, args.threshold))
    worst = {n: max(r[f"random_p_retire_n{n}"] for r in rows) for n in PLAYS}
    out: dict[str, Any] = {"rows": rows, "worst_random": worst, "load": os.getloadavg()}
    if args.cost:
        out["sandbox_s_for_8_audit_plays"] = round(asyncio.run(sandbox_cost(4)), 3)
    if args.json:
        print(json.dumps(out, indent=2))
        return
    for r in rows:
        chances = " ".join(f"n={n}:{r[f'random_p_retire_n{n}']:.3f}" for n in PLAYS)
        print(f"{r['env']:<24} noop mean {r['noop_mean']:.2f}  random mean {r['random_mean']:.2f}  P(retire) {chances}")
    print("worst P(retire) of an honest env by the random policy:", worst)
    if args.cost:
        print("8 audit plays through the sandbox pool:", out["sandbox_s_for_8_audit_plays"], "s")


if __name__ == "__main__":
    main()
