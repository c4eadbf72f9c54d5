"""Queue throughput: RedisStreamQueue against redis-benchmark's raw XADD on the same Redis, in the same run.

Measures, with ``--clients`` C concurrent producers (each its own connection pool) and batches of
``--batch`` B messages:

- ``publish`` one message per call (one round trip each), 1 client and C clients;
- ``publish_many`` in batches of B (one script call per batch), C clients;
- ``consume`` + ``ack_many`` (batches of B), one consumer;

and the baselines ``redis-benchmark XADD`` with 1 and C clients (one command per round trip, ``-P 1``)
and with C clients pipelining B commands (``-P B``). The ratios put each queue figure over the
baseline with the same client count (the issue's target: publish_many >= 0.5x redis-benchmark XADD
with the same client count). A queue message costs more than a bare XADD: the key check, the
bound check and the key record (idempotency and back-pressure) run with it, in one script.

Not a test: nothing is asserted. Usage:

    .venv/bin/python bench/queue_bench.py [--n 20000] [--clients 16] [--batch 100] [--payload 512] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import time
import uuid
from typing import Any
from urllib.parse import urlsplit

from spade.queues import RedisQueueConfig
from spade.queues.redis_streams import RedisStreamQueue

STREAM = "bench.stream"


def redis_benchmark(n: int, clients: int, payload: int, host: str, port: int, pipeline: int = 1) -> float | None:
    """XADD requests/s measured by redis-benchmark (None when it is not installed)."""
    exe = shutil.which("redis-benchmark")
    if exe is None:
        return None
    key = f"bench:raw:{uuid.uuid4().hex}"
    command = [exe, "-h", host, "-p", str(port), "-q", "-n", str(n), "-c", str(clients), "-P", str(pipeline)]
    command += ["XADD", key, "*", "k", "key-0000000000", "d", "x" * payload]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    subprocess.run(
        [shutil.which("redis-cli") or "redis-cli", "-h", host, "-p", str(port), "DEL", key],
        capture_output=True,
        check=False,
    )
    m = re.findall(r"([\d.]+) requests per second", out)
    return float(m[-1]) if m else None


async def measure(args: argparse.Namespace) -> dict[str, float]:
    """The queue's rates (messages/s), each phase on a fresh prefix."""
    payload = b"x" * args.payload
    rates: dict[str, float] = {}

    def queue(prefix: str) -> RedisStreamQueue:
        cfg = RedisQueueConfig(url=args.url, prefix=prefix, max_len=args.n * 4, claim_idle_ms=600_000)
        return RedisStreamQueue(cfg)

    async def phase(name: str, clients: int, work: Any) -> RedisStreamQueue:
        prefix = f"bench:{uuid.uuid4().hex}:"
        queues = [queue(prefix) for _ in range(clients)]
        per = args.n // clients
        start = time.perf_counter()
        await asyncio.gather(*(work(q, c, per) for c, q in enumerate(queues)))
        rates[name] = per * clients / (time.perf_counter() - start)
        for q in queues[1:]:
            await q.close()
        return queues[0]

    async def one_by_one(q: RedisStreamQueue, c: int, per: int) -> None:
        for i in range(per):
            await q.publish(STREAM, payload, key=f"c{c}-{i}")

    async def batched(q: RedisStreamQueue, c: int, per: int) -> None:
        for start in range(0, per, args.batch):
            batch = [(f"c{c}-{i}", payload) for i in range(start, min(per, start + args.batch))]
            await q.publish_many(STREAM, batch)

    for name, clients, work in (
        ("publish_1_client", 1, one_by_one),
        ("publish_c_clients", args.clients, one_by_one),
    ):
        q = await phase(name, clients, work)
        await q.delete_all()
        await q.close()

    q = await phase("publish_many_c_clients", args.clients, batched)
    total = await q.length(STREAM)
    start = time.perf_counter()
    done = 0
    while done < total:
        batch = await q.consume(STREAM, "bench", "c1", count=args.batch, block_ms=100)
        await q.ack_many(STREAM, "bench", [d.message_id for d in batch])
        done += len(batch)
    rates["consume_ack_many_1_client"] = total / (time.perf_counter() - start)
    await q.delete_all()
    await q.close()
    return rates


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="redis://127.0.0.1:6379/0")
    p.add_argument("--n", type=int, default=20_000, help="messages per phase")
    p.add_argument("--clients", type=int, default=16, help="concurrent producers (and redis-benchmark clients)")
    p.add_argument("--batch", type=int, default=100, help="messages per publish_many / ack_many call")
    p.add_argument("--payload", type=int, default=512, help="payload bytes per message")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = p.parse_args()

    load = os.getloadavg()
    rates = asyncio.run(measure(args))
    parts = urlsplit(args.url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 6379
    baseline = {
        "xadd_1_client": redis_benchmark(args.n, 1, args.payload, host, port),
        "xadd_c_clients": redis_benchmark(args.n, args.clients, args.payload, host, port),
        "xadd_c_clients_pipelined": redis_benchmark(args.n, args.clients, args.payload, host, port, args.batch),
    }

    def ratio(x: float, base: float | None) -> float | None:
        return round(x / base, 3) if base else None

    ratios = {
        "publish_1_client / xadd_1_client": ratio(rates["publish_1_client"], baseline["xadd_1_client"]),
        "publish_c_clients / xadd_c_clients": ratio(rates["publish_c_clients"], baseline["xadd_c_clients"]),
        "publish_many_c_clients / xadd_c_clients": ratio(rates["publish_many_c_clients"], baseline["xadd_c_clients"]),
        "publish_many_c_clients / xadd_c_clients_pipelined": ratio(
            rates["publish_many_c_clients"], baseline["xadd_c_clients_pipelined"]
        ),
        "consume_ack_many_1_client / xadd_1_client": ratio(
            rates["consume_ack_many_1_client"], baseline["xadd_1_client"]
        ),
    }
    if args.json:
        print(
            json.dumps(
                {
                    "benchmark": "queue",
                    "params": {k: getattr(args, k) for k in ("n", "clients", "batch", "payload", "url")},
                    "figures": {k: round(v, 1) for k, v in rates.items()},
                    "baseline": baseline,
                    "ratios": ratios,
                    "loadavg_at_start": [round(x, 2) for x in load],
                    "unit": "messages or requests per second",
                }
            )
        )
        return
    print(f"{args.n} messages x {args.payload} B, {args.clients} clients, batches of {args.batch}, Redis at {args.url}")
    print(f"load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    for name, value in baseline.items():
        print(f"redis-benchmark {name:<28} {value or float('nan'):>10.0f} req/s")
    for name, value in rates.items():
        print(f"RedisStreamQueue {name:<27} {value:>10.0f} msg/s")
    for name, value in ratios.items():
        print(f"ratio {name:<50} {'n/a (redis-benchmark missing)' if value is None else f'{value:.2f}x'}")


if __name__ == "__main__":
    main()
