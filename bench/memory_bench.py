"""Memory store figures on the real Postgres: environment inserts/s and SampleExamples latency with
100k environments, each against a same-run baseline of the bare SQL doing the same job.

- inserts: ``SqlStore.put_environment`` (normalise + hash + dedup check + env and stats rows, one
  transaction each) vs. a bare single-row ``INSERT`` + commit per environment;
- SampleExamples: ``MemoryService.sample_examples`` in-process and ``MemoryClient.sample_examples``
  over gRPC loopback vs. the bare window query it runs (``SELECT ... LIMIT window``, no code; the
  service then fetches the code of the three or so environments it chose).

Runs in a throw-away schema that is dropped at the end. Not a test: nothing is asserted.

    .venv/bin/python bench/memory_bench.py [--n 100000] [--puts 1000] [--samples 200] [--json]

``--json`` prints one object instead: the settings, ``os.getloadavg()`` at start, our figures, the
baseline's (the bare SQL's) and the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import statistics
import time
import uuid
from datetime import UTC, datetime

from sqlalchemy import create_engine, insert, text

from services.memory.grpc_server import grpc_service
from services.memory.service import MemoryService
from services.memory.store.models import EnvironmentRow, EnvStatsRow
from services.memory.store.sql import SqlStore, make_engine, migrate
from spade.envs.types import Setting
from spade.memory.client import MemoryClient
from spade.memory.records import NewEnvironment
from spade.serving.grpc import grpc_server
from spade.serving.settings import ServerAddress

SKILLS = [
    (Setting.GAME, s)
    for s in (
        "Mathematical Reasoning",
        "Logical Deduction",
        "Spatial Reasoning",
        "Pattern Recognition",
        "Optimization",
        "Causal Inference",
    )
] + [
    (Setting.TOOL, s)
    for s in (
        "API Orchestration",
        "Data Retrieval",
        "State Modification",
        "Error Recovery",
        "Tool Selection",
        "Multi-Step Workflows",
    )
]


def code_for(i: int) -> str:
    return (
        f'import random\n\n\nclass Puzzle{i}Env:\n    """Puzzle number {i}."""\n    max_turns = 8\n\n'
        f"    def reset(self, seed=None):\n        self.rng = random.Random(seed)\n"
        f"        self.target = self.rng.randint(1, {i % 997 + 10})\n        return 'Guess a number', {{}}\n\n"
        f"    def step(self, action):\n        won = action.strip() == str(self.target)\n"
        f"        return ('win' if won else 'no'), float(won), won, False, {{}}\n\n"
        f"    def solution(self):\n        return [str(self.target)]\n"
    )


def pct(xs: list[float], p: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(p * len(xs)))]


def bulk_load(engine, start: int, n: int) -> None:  # type: ignore[no-untyped-def]
    """Fill the store fast (untimed): unique code, so a plain hash stands in for the normalised one."""
    rng = random.Random(0)
    now = datetime.now(UTC)
    batch = 5000
    for lo in range(start, start + n, batch):
        envs: list[dict[str, object]] = []
        stats: list[dict[str, object]] = []
        for i in range(lo, min(lo + batch, start + n)):
            setting, skill = SKILLS[i % len(SKILLS)]
            code = code_for(i)
            env_id = uuid.uuid4().hex
            envs.append(
                dict(
                    id=env_id,
                    setting=setting,
                    skill=skill,
                    code=code,
                    code_hash=hashlib.sha256(code.encode()).hexdigest(),
                    hint="h",
                    env_class=f"Puzzle{i}Env",
                    corpus_ref="",
                    validation_report={"valid": True},
                    status="valid",
                    weight_version=i // 1000,
                    designer_sample_id="",
                    batch_id="",
                    parent_ids=[],
                    created_at=now,
                )
            )
            scored = rng.random() < 0.8
            stats.append(
                dict(
                    env_id=env_id,
                    plays=16 if scored else 0,
                    window_plays=8 if scored else 0,
                    win_rate=rng.random() if scored else None,
                    regret=rng.uniform(-0.2, 0.8) if scored else None,
                    learnable=False,
                    reward_components={},
                    updated_at=now,
                )
            )
        with engine.begin() as c:
            c.execute(insert(EnvironmentRow), envs)
            c.execute(insert(EnvStatsRow), stats)


async def run(args: argparse.Namespace) -> None:
    load_start = os.getloadavg()
    schema = f"bench_{uuid.uuid4().hex[:12]}"
    admin = create_engine(args.url, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(text(f'CREATE SCHEMA "{schema}"'))
    engine = make_engine(args.url, connect_args={"options": f"-csearch_path={schema}"}, pool_size=8)
    try:
        migrate(engine)
        store = SqlStore(engine)
        with engine.begin() as c:
            c.execute(text("CREATE TABLE raw_insert (id text primary key, setting text, skill text, code text)"))

        # -- inserts: baseline, then the store ------------------------------------------------------
        t = time.perf_counter()
        for i in range(args.puts):
            with engine.begin() as c:
                c.execute(
                    text("INSERT INTO raw_insert VALUES (:i, 'game', 'Optimization', :c)"),
                    {"i": uuid.uuid4().hex, "c": code_for(10_000_000 + i)},
                )
        raw_rate = args.puts / (time.perf_counter() - t)
        t = time.perf_counter()
        for i in range(args.puts):
            setting, skill = SKILLS[i % len(SKILLS)]
            store.put_environment(NewEnvironment(setting=setting, skill=skill, code=code_for(20_000_000 + i)))
        put_rate = args.puts / (time.perf_counter() - t)

        # -- fill to n, then sample ----------------------------------------------------------------
        t = time.perf_counter()
        bulk_load(engine, 0, max(0, args.n - args.puts))
        load_s = time.perf_counter() - t
        with engine.begin() as c:
            c.execute(text("ANALYZE"))
            total = c.execute(text("SELECT count(*) FROM environments")).scalar()

        service = MemoryService(store)
        rng = random.Random(1)
        raw_lat, svc_lat, grpc_lat = [], [], []
        window_sql = text(
            "SELECT e.id, e.seq, e.skill, s.win_rate, s.regret, s.window_plays "
            "FROM environments e JOIN env_stats s ON s.env_id = e.id "
            "WHERE e.setting = :st AND e.skill = :sk AND s.win_rate IS NOT NULL ORDER BY e.seq DESC LIMIT 200"
        )
        for _ in range(args.samples):
            setting, skill = rng.choice(SKILLS)
            t = time.perf_counter()
            with engine.connect() as c:
                c.execute(window_sql, {"st": setting, "sk": skill}).all()
            raw_lat.append(time.perf_counter() - t)
            t = time.perf_counter()
            await service.sample_examples(setting, skill, 2, 1, seed=rng.randrange(1 << 30))
            svc_lat.append(time.perf_counter() - t)
        async with grpc_server([grpc_service(service)], ServerAddress(port=0), service="memory") as running:
            client = MemoryClient(f"127.0.0.1:{running.port}")
            for _ in range(args.samples):
                setting, skill = rng.choice(SKILLS)
                t = time.perf_counter()
                await client.sample_examples(setting, skill, 2, 1, seed=rng.randrange(1 << 30))
                grpc_lat.append(time.perf_counter() - t)
            await client.close()
    finally:
        engine.dispose()
        with admin.connect() as c:
            c.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()

    ms = 1000.0
    latency = {"bare": raw_lat, "in_process": svc_lat, "grpc": grpc_lat}
    p50 = {name: statistics.median(xs) * ms for name, xs in latency.items()}
    p95 = {name: pct(xs, 0.95) * ms for name, xs in latency.items()}
    if args.json:
        figures = {
            "benchmark": "memory",
            "settings": {"n": total, "puts": args.puts, "samples": args.samples},
            "loadavg_start": list(load_start),
            "figures": {
                "put_environment_per_s": put_rate,
                "sample_examples_in_process": {"p50_ms": p50["in_process"], "p95_ms": p95["in_process"]},
                "sample_examples_grpc": {"p50_ms": p50["grpc"], "p95_ms": p95["grpc"]},
            },
            "baseline": {
                "name": "bare SQL",
                "insert_commit_per_s": raw_rate,
                "window_query": {"p50_ms": p50["bare"], "p95_ms": p95["bare"]},
            },
            "ratios": {
                "put_vs_insert_rate": put_rate / raw_rate,
                "sample_in_process_vs_query_p50": p50["in_process"] / p50["bare"],
                "sample_grpc_vs_query_p50": p50["grpc"] / p50["bare"],
            },
        }
        print(json.dumps(figures, indent=2))
        return
    print(f"Postgres {args.url}; environments in store: {total} (bulk load of the rest took {load_s:.1f}s)")
    print(f"bare INSERT + commit:                  {raw_rate:8.0f} rows/s")
    print(f"SqlStore.put_environment:              {put_rate:8.0f} envs/s   ratio {put_rate / raw_rate:.2f}x")
    for name, xs in (
        ("bare window query", raw_lat),
        ("SampleExamples in-process", svc_lat),
        ("SampleExamples over gRPC", grpc_lat),
    ):
        ratio = statistics.median(xs) / statistics.median(raw_lat)
        print(
            f"{name + ':':38} p50 {statistics.median(xs) * ms:6.2f} ms  p95 {pct(xs, 0.95) * ms:6.2f} ms"
            f"   ratio {ratio:.2f}x (p50 vs bare query)"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="postgresql+psycopg://postgres@127.0.0.1:5432/test")
    p.add_argument("--n", type=int, default=100_000, help="environments in the store while sampling")
    p.add_argument("--puts", type=int, default=1000, help="environments inserted one by one (timed)")
    p.add_argument("--samples", type=int, default=200, help="SampleExamples calls timed per path")
    p.add_argument("--json", action="store_true", help="print one JSON object with every figure")
    asyncio.run(run(p.parse_args()))


if __name__ == "__main__":
    main()
