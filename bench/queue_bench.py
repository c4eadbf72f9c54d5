"""Queue throughput: RedisStreamQueue against redis-benchmark's raw XADD rate on the same Redis.

Prints messages/s for the project's queue (sequential publish, concurrent publish, consume+ack) and
redis-benchmark's XADD requests/s with the same number of clients, and their ratios. Not a test:
nothing is asserted. Usage:

    .venv/bin/python bench/queue_bench.py [--n 20000] [--clients 16] [--payload 512]
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import subprocess
import time
import uuid

from spade.queues import RedisQueueConfig
from spade.queues.redis_streams import RedisStreamQueue

STREAM = "bench.stream"


def redis_benchmark(n: int, clients: int, payload: int, host: str, port: int) -> float | None:
    """XADD requests/s measured by redis-benchmark (None when it is not installed)."""
    exe = shutil.which("redis-benchmark")
    if exe is None:
        return None
    key = f"bench:raw:{uuid.uuid4().hex}"
    out = subprocess.run(
        [
            exe,
            "-h",
            host,
            "-p",
            str(port),
            "-q",
            "-n",
            str(n),
            "-c",
            str(clients),
            "XADD",
            key,
            "*",
            "k",
            "key-0000000000",
            "d",
            "x" * payload,
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    subprocess.run(
        [shutil.which("redis-cli") or "redis-cli", "-h", host, "-p", str(port), "DEL", key],
        capture_output=True,
        check=False,
    )
    m = re.findall(r"([\d.]+) requests per second", out)
    return float(m[-1]) if m else None


async def run(args: argparse.Namespace) -> None:
    prefix = f"bench:{uuid.uuid4().hex}:"
    cfg = RedisQueueConfig(url=args.url, prefix=prefix, max_len=max(args.n * 2, 10), claim_idle_ms=600_000)
    q = RedisStreamQueue(cfg)
    payload = b"x" * args.payload
    try:
        t = time.perf_counter()
        for i in range(args.n):
            await q.publish(STREAM, payload, key=f"s{i}")
        seq_rate = args.n / (time.perf_counter() - t)

        t = time.perf_counter()
        per = args.n // args.clients

        async def producer(c: int) -> None:
            for i in range(per):
                await q.publish(STREAM, payload, key=f"c{c}-{i}")

        await asyncio.gather(*(producer(c) for c in range(args.clients)))
        conc_rate = per * args.clients / (time.perf_counter() - t)

        total = args.n + per * args.clients
        t = time.perf_counter()
        done = 0
        while done < total:
            batch = await q.consume(STREAM, "bench", "c1", count=100, block_ms=100)
            for d in batch:
                await q.ack(STREAM, "bench", d.message_id)
            done += len(batch)
        consume_rate = total / (time.perf_counter() - t)
    finally:
        await q.delete_all()
        await q.close()

    host, port = re.match(r"redis://([^:/]+):?(\d+)?", args.url).groups()  # type: ignore[union-attr]
    raw1 = redis_benchmark(args.n, 1, args.payload, host, int(port or 6379))
    rawc = redis_benchmark(args.n, args.clients, args.payload, host, int(port or 6379))

    def ratio(x: float, base: float | None) -> str:
        return f"{x / base:.2f}x" if base else "n/a (redis-benchmark missing)"

    print(f"messages: {args.n} x {args.payload} B payload, Redis at {args.url}")
    print(f"redis-benchmark XADD, 1 client:            {raw1 or float('nan'):>10.0f} req/s")
    print(f"redis-benchmark XADD, {args.clients} clients:          {rawc or float('nan'):>10.0f} req/s")
    print(f"RedisStreamQueue.publish, sequential:      {seq_rate:>10.0f} msg/s   ratio {ratio(seq_rate, raw1)}")
    print(
        f"RedisStreamQueue.publish, {args.clients} concurrent:   {conc_rate:>10.0f} msg/s   "
        f"ratio {ratio(conc_rate, rawc)}"
    )
    print(f"RedisStreamQueue.consume+ack (batch 100):  {consume_rate:>10.0f} msg/s   ratio {ratio(consume_rate, raw1)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="redis://127.0.0.1:6379/0")
    p.add_argument("--n", type=int, default=20_000)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--payload", type=int, default=512)
    asyncio.run(run(p.parse_args()))


if __name__ == "__main__":
    main()
