"""The distributed system brought up by ``spade cluster`` for an end-to-end test.

Shared by ``test_distributed.py`` and ``test_chaos.py``: the whole deployment of ``deploy/spade.env``
and ``deploy/local.env`` as docs/distributed.md tells a user to run it, with only what a test must
change set in the environment (which wins over the files' lines): a run directory under tmp, free
ports, its own queue prefix and database, CI-sized runner budgets, and (the chaos test) its own
Redis and Postgres.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import redis

from services.cluster.envfile import DEFAULT_ENV_FILES
from services.cluster.runner import Cluster
from spade.queues.base import SAMPLES_DESIGNER, WEIGHTS_PUBLISHED
from spade.queues.config import RedisQueueConfig
from spade.queues.redis_streams import RedisStreamQueue
from spade.runspec import RunSpec
from spade.v1 import queues_pb2, types_pb2
from tests.conftest import REDIS_URL
from tests.e2e.machine import timed_out

ROOT = Path(__file__).resolve().parents[2]
SPADE = [sys.executable, "-m", "spade.cli"]
ENV_FILES = [ROOT / f for f in DEFAULT_ENV_FILES]
POSTGRES = "postgresql://postgres@127.0.0.1:5432"
"""The machine's shared Postgres server (no database): each cluster gets a fresh database on it."""


def free_port() -> int:
    """A TCP port of 127.0.0.1 free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def next_message(stream: str, cluster: RunnerCluster, timeout_s: float) -> bytes:
    """The first message on ``stream`` seen by the test's own consumer group (waits for it)."""

    async def poll() -> bytes | None:
        observer = RedisStreamQueue(RedisQueueConfig.model_validate(cluster.queue))
        try:
            got = await observer.consume(stream, "e2e-observer", "test", block_ms=1000)
            return got[0].payload if got else None
        finally:
            await observer.close()

    deadline = time.monotonic() + timeout_s
    while True:
        cluster.check_alive()
        payload = asyncio.run(poll())
        if payload is not None:
            return payload
        assert time.monotonic() < deadline, f"nothing arrived on {stream} within {timeout_s} s\n{cluster.logs()}"


def spec_and_pool(tmp_path: Path, spec: RunSpec) -> tuple[Path, Path]:
    """Write ``spec`` as the run-spec file and a designer-pool directory holding one valid answer (a
    short number-hunt game with graded returns); returns both paths, for ``SPADE_CLUSTER_RUN_SPEC``
    and ``SPADE_DESIGNER_POOL_DIR``."""
    spec_file = tmp_path / "runspec.json"
    spec_file.write_text(spec.to_json())
    pool = tmp_path / "pool"
    pool.mkdir()
    answer = ROOT / "tests" / "fixtures" / "designer_pool" / "game" / "valid-number_hunt.md"
    (pool / answer.name).write_text(answer.read_text())
    return spec_file, pool


def warmup_group(spec_id: str) -> list[queues_pb2.AgentSample]:
    """Four plays of a made-up env with varying returns: a learner step's worth, so it publishes v1."""
    out = []
    for seed, ret in enumerate([1.0, 0.0, 0.5, 0.0]):
        tokens = [1, 5, 9, 13, 17, 21, 25, 29]
        out.append(
            queues_pb2.AgentSample(
                sample_id=f"warmup@s0/plain/{seed}",
                env_id="warmup",
                setting=types_pb2.SETTING_GAME,
                skill="Optimization",
                seed=seed,
                group_id="warmup@s0",
                token_ids=tokens,
                logprobs=[0.0, 0.0, 0.0, -2.0, -2.5, -3.0, -1.5, -2.0],
                loss_mask=[False, False, False, True, True, True, True, True],
                episode_return=ret,
                turns=1,
                weight_version=0,
                finish_reason=types_pb2.FINISH_REASON_TERMINATED,
                spec_id=spec_id,
                window_start=0,
                window_index=0,
            )
        )
    return out


class RunnerCluster:
    """The deployment ``spade cluster`` runs from its env files (``deploy/spade.env``,
    ``deploy/local.env``), with the test's overrides in the environment of every ``spade cluster``
    command (as a user exports them).

    The test reads the runner's own record of it (``services.cluster.runner.Cluster``: the pids in
    ``<run dir>/state.json``, the logs in ``<run dir>/logs``) to fail fast when a member died.

    Args:
        tmp: Where the run directory goes.
        redis_url: The Redis every service shares (default: this machine's).
        postgres: The Postgres server (``postgresql://user@host:port``) the cluster's database is created on.
        extra: More variables for every ``spade cluster`` command.
    """

    def __init__(self, tmp: Path, *, redis_url: str = REDIS_URL, postgres: str = POSTGRES, **extra: str) -> None:
        self.db_name = f"spade_e2e_{uuid.uuid4().hex[:10]}"
        self.prefix = f"e2e-{uuid.uuid4().hex[:8]}:"
        self.redis_url = redis_url
        self.admin_dsn = f"{postgres}/postgres"
        database = f"{postgres.replace('postgresql://', 'postgresql+psycopg://', 1)}/{self.db_name}"
        ports = ("SANDBOX_GRPC", "SANDBOX_HTTP", "MEMORY_GRPC", "MEMORY_HTTP", "INFERENCE")
        overrides = {
            **{f"SPADE_LOCAL_{port}_PORT": str(free_port()) for port in ports},
            "SPADE_LOCAL_REDIS_URL": redis_url,
            "SPADE_LOCAL_QUEUE_PREFIX": self.prefix,
            "SPADE_LOCAL_DATABASE_URL": database,  # created by `up`
            "SPADE_LOCAL_DATA_DIR": str(tmp / "cluster"),
            # CI-sized runner budgets: a member that cannot start fails in minutes; `down` does not linger.
            "SPADE_CLUSTER_HEALTH_TIMEOUT_S": "300",
            "SPADE_CLUSTER_STOP_GRACE_S": "20",
            # Content env ids: the designed env's play and audit seeds derive from its id, so with random
            # ids about 1 run in 100 had the audit's random policy beat number_hunt's cap and retire it.
            # The prefix above keeps this run's queue keys apart from any other run on this Redis.
            "SPADE_MEMORY_CONTENT_ENV_IDS": "true",
            **extra,
        }
        # A developer's shell may hold SPADE_* variables (keys, ports): only the test's own apply.
        base = {k: v for k, v in os.environ.items() if not k.startswith("SPADE_")}
        self.environ = {**base, "HF_HUB_OFFLINE": "1", **overrides}
        self.runner = Cluster(ENV_FILES, environ=self.environ)
        self.dsn = database.replace("+psycopg", "")
        self.queue = {"kind": "redis", "url": redis_url, "prefix": self.prefix}
        self.names: list[str] = []
        self.killed: set[str] = set()

    def spade(self, *args: str, timeout_s: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
        """``spade ARGS`` as a user runs it, from the repository root (so the env files are the default ones)."""
        try:
            done = subprocess.run(
                [*SPADE, *args],
                cwd=ROOT, env=self.environ, capture_output=True, text=True, timeout=timeout_s, check=False,
            )  # fmt: skip
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(f"{timed_out(exc)}\n{self.logs()}") from exc
        if check:
            assert done.returncode == 0, (
                f"spade {' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}\n{self.logs()}"
            )
        return done

    def observe(self) -> None:
        """The test's own consumer groups on the streams it reads, made before anything is published
        there: a message stays in its stream until every group has acknowledged it."""

        async def create() -> None:
            observer = RedisStreamQueue(RedisQueueConfig.model_validate(self.queue))
            for watched in (WEIGHTS_PUBLISHED, SAMPLES_DESIGNER):
                await observer.consume(watched, "e2e-observer", "test", block_ms=1)
            await observer.close()

        asyncio.run(create())

    def up(self, **changed: str) -> None:
        """``spade cluster up`` (with ``changed`` variables from now on): starts what is not running."""
        self.environ.update(changed)
        self.runner = Cluster(ENV_FILES, environ=self.environ)
        done = self.spade("cluster", "up")
        assert "cluster up" in done.stdout, done.stdout + done.stderr
        self.names = [member.name for member in self.runner.members()]
        self.killed.clear()  # every member runs again

    def kill(self, name: str, signal: str = "KILL", wait_s: float = 30) -> None:
        """``spade cluster kill NAME`` (kill -9 of its process group; ``TERM`` to stop it), waited for until gone."""
        self.spade("cluster", "kill", name, "--signal", signal)
        self.killed.add(name)
        deadline = time.monotonic() + wait_s
        while self.runner.pid(name) is not None:
            assert time.monotonic() < deadline, f"{name} still runs {wait_s:.0f} s after spade cluster kill"
            time.sleep(0.1)

    def status(self) -> dict[str, Any]:
        """``spade cluster status --json``."""
        report: dict[str, Any] = json.loads(self.spade("cluster", "status", "--json").stdout)
        return report

    def check_alive(self) -> None:
        for name in self.names:
            if name not in self.killed and self.runner.pid(name) is None:
                raise AssertionError(f"{name} is not running; its log ends:\n{self.runner.log_tail(name)}")

    def logs(self) -> str:
        """The tail of every member's log, for failure messages."""
        return "\n".join(f"--- {name}\n{self.runner.log_tail(name, 1500)}" for name in self.names)

    def down(self) -> None:
        """``spade cluster down``, then every member checked stopped (``spade cluster status``)."""
        self.spade("cluster", "down")
        members = self.status()["members"]
        assert all(m["pid"] is None for m in members.values()), members


@contextlib.contextmanager
def running_cluster(
    tmp: Path, *, redis_url: str = REDIS_URL, postgres: str = POSTGRES, clean: bool = True, **extra: str
) -> Iterator[RunnerCluster]:
    """A :class:`RunnerCluster` (not up yet; the test's consumer groups made), and whatever happens,
    ``spade cluster down`` afterwards.

    Args:
        tmp: Where the run directory goes.
        redis_url: The Redis the cluster uses.
        postgres: The Postgres server its database is created on.
        clean: Remove its queue's keys and its database afterwards (on servers that outlive the test).
        extra: More variables for every ``spade cluster`` command.
    """
    cluster = RunnerCluster(tmp, redis_url=redis_url, postgres=postgres, **extra)
    try:
        cluster.observe()
        yield cluster
    finally:
        cluster.spade("cluster", "down", check=False)
        if clean:
            r = redis.Redis.from_url(redis_url)
            try:
                for key in r.scan_iter(f"{cluster.prefix}*"):
                    r.delete(key)
            finally:
                r.close()
            with psycopg.connect(cluster.admin_dsn, autocommit=True) as conn:
                conn.execute(f"DROP DATABASE IF EXISTS {cluster.db_name} WITH (FORCE)")
