"""Distributed mode end to end: every service a separate ``spade serve`` process, talking gRPC on
loopback, through the real Redis and Postgres of this machine, under a run spec stored in the memory
as an operator stores it (``spade runspec set``). One learner step lands, and a rollout worker SIGKILLed
mid-play has its window slot taken over by the other worker once its lease lapses: nothing lost,
nothing twice. A designer sample is scored from its env's own window slots even when the learner
published between the design and the env's first play."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis

from services.sandbox.core.auth import hash_key
from spade.queues.base import SAMPLES_DESIGNER, WEIGHTS_PUBLISHED
from spade.queues.config import RedisQueueConfig
from spade.queues.redis_streams import RedisStreamQueue
from spade.runspec import RunSpec
from spade.v1 import queues_pb2
from tests.conftest import REDIS_URL

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

ROOT = Path(__file__).resolve().parents[2]
SPADE = [sys.executable, "-m", "spade.cli"]
G = 8
SANDBOX_KEY = "e2e-sandbox-key"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def database() -> Iterator[str]:
    """A fresh Postgres database for this test (memory + rollout state), dropped afterwards."""
    name = f"spade_e2e_{uuid.uuid4().hex[:10]}"
    with psycopg.connect("postgresql://postgres@127.0.0.1:5432/test", autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    finally:
        with psycopg.connect("postgresql://postgres@127.0.0.1:5432/test", autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


class Cluster:
    """The processes of one distributed deployment, each with its own log file."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        log = (self.tmp / f"{name}.log").open("wb")
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", **env}
        proc = subprocess.Popen([*SPADE, *args], cwd=ROOT, env=full_env, stdout=log, stderr=subprocess.STDOUT)
        self.procs[name] = proc
        return proc

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None and not name.endswith("-killed"):
                log = (self.tmp / f"{name}.log").read_text()[-3000:]
                raise AssertionError(f"{name} exited with {proc.returncode}:\n{log}")

    def logs(self) -> str:
        """The tail of every process's log, for failure messages."""
        return "\n".join(
            f"--- {path.stem}\n{path.read_text(errors='replace')[-1500:]}" for path in sorted(self.tmp.glob("*.log"))
        )

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def _wait_port(port: int, cluster: Cluster, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        cluster.check_alive()
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return
        time.sleep(0.25)
    raise AssertionError(f"nothing listened on port {port} within {timeout_s} s")


def _next_message(stream: str, queue: dict[str, Any], cluster: Cluster, timeout_s: float) -> bytes:
    """The first message on ``stream`` seen by the test's own consumer group (waits for it)."""

    async def poll() -> bytes | None:
        observer = RedisStreamQueue(RedisQueueConfig.model_validate(queue))
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


STEP_SPEC = {
    "temperature": 1.0,
    "group_size": G,
    "window_versions_game": 1,
    "agent_max_turns": 3,
    # Long enough for a guess in most replies: NumberHunt's graded reward then differs across seeds
    # (each has its own target), so the group has the variance the learner needs.
    "agent_max_tokens_per_turn": 16,
    "agent_max_total_tokens": 2048,
    "designer_max_new_tokens": 32,
    "envs_per_round": 1,
    "skills_per_round": 1,
}
"""The run spec of the one-step test: the settings every service takes from the memory."""


def _store_run_spec(fields: dict[str, Any], memory: str, tmp: Path) -> RunSpec:
    """Store the run spec in the memory the way an operator does (``spade runspec set FILE``)."""
    spec = RunSpec.model_validate(fields)
    spec_file = tmp / "runspec.json"
    spec_file.write_text(spec.to_json())
    stored = subprocess.run(
        [*SPADE, "runspec", "set", str(spec_file), "--memory", memory],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert stored.returncode == 0 and spec.spec_id in stored.stdout, stored.stdout + stored.stderr
    return spec


def test_one_step_across_processes_and_a_killed_rollout_worker(tmp_path: Path, database: str) -> None:
    prefix = f"e2e-{uuid.uuid4().hex[:8]}:"
    ports = {name: _free_port() for name in ("sb_grpc", "sb_http", "mem_grpc", "mem_rest", "inference")}
    memory = f"127.0.0.1:{ports['mem_grpc']}"
    inference_url = f"http://127.0.0.1:{ports['inference']}"
    queue = {"kind": "redis", "url": REDIS_URL, "prefix": prefix}
    rollout_queue = {**queue, "claim_idle_ms": 15_000}
    cluster = Cluster(tmp_path)
    r = redis.Redis.from_url(REDIS_URL)

    try:
        cluster.start(
            "sandbox",
            ["serve", "sandbox", "--grpc-port", str(ports["sb_grpc"]), "--http-port", str(ports["sb_http"])],
            {"SPADE_SANDBOX_API_KEYS": json.dumps([{"tenant": "e2e", "key_sha256": hash_key(SANDBOX_KEY)}])},
        )
        cluster.start(
            "memory",
            ["serve", "memory"],
            {
                "SPADE_MEMORY_DEV_MODE": "true",
                "SPADE_MEMORY_DATABASE_URL": database,
                "SPADE_MEMORY_GRPC__HOST": "127.0.0.1",
                "SPADE_MEMORY_GRPC__PORT": str(ports["mem_grpc"]),
                "SPADE_MEMORY_HTTP__PORT": str(ports["mem_rest"]),
            },
        )
        cluster.start("inference", ["serve", "inference", "--port", str(ports["inference"])], {})
        for port in ports.values():
            _wait_port(port, cluster)
        _store_run_spec(STEP_SPEC, memory, tmp_path)

        # The seed pool, as an operator loads it: validated by the sandbox, stored, announced.
        seeded = subprocess.run(
            [
                *SPADE, "envs", "seed",
                "--memory", memory,
                "--queue", json.dumps(queue),
                "--sandbox", f"127.0.0.1:{ports['sb_grpc']}",
                "--sandbox-key", SANDBOX_KEY,
                "--example", "number_hunt",
            ],
            cwd=ROOT, capture_output=True, text=True, timeout=300, check=True,
        )  # fmt: skip
        assert "seed pool: 1 game environments" in seeded.stdout, seeded.stdout
        env_id = seeded.stdout.split()[-1]

        async def observe() -> None:
            # Our own consumer groups, made before anything is published there: a message stays in
            # its stream until every group has acknowledged it.
            observer = RedisStreamQueue(RedisQueueConfig.model_validate(queue))
            for watched in (WEIGHTS_PUBLISHED, SAMPLES_DESIGNER):
                await observer.consume(watched, "e2e-observer", "test", block_ms=1)
            await observer.close()

        asyncio.run(observe())

        rollout_env = {
            "SPADE_ROLLOUT_QUEUE": json.dumps(rollout_queue),
            "SPADE_ROLLOUT_SANDBOX": json.dumps(
                {"kind": "grpc", "target": f"127.0.0.1:{ports['sb_grpc']}", "api_key": SANDBOX_KEY}
            ),
            "SPADE_ROLLOUT_MEMORY": json.dumps({"kind": "grpc", "target": memory}),
            "SPADE_ROLLOUT_INFERENCE_URLS": json.dumps([inference_url]),
            "SPADE_ROLLOUT_STATE_URL": database,
            "SPADE_ROLLOUT_BLOCK_MS": "200",
        }
        workers = {}
        for name in ("rollout-a", "rollout-b"):
            workers[name] = cluster.start(
                name, ["serve", "rollout"], {**rollout_env, "SPADE_ROLLOUT_CONSUMER_NAME": name}
            )

        # Kill whichever worker holds the env's first window slot (its lease in the rollout's shared
        # state), once one of its plays is recorded and the others are in flight.
        deadline = time.monotonic() + 600
        owner = None
        with psycopg.connect(database.replace("+psycopg", ""), autocommit=True) as conn:
            while owner is None:
                cluster.check_alive()
                assert time.monotonic() < deadline, f"no rollout worker played the env\n{cluster.logs()}"
                with contextlib.suppress(psycopg.errors.UndefinedTable):
                    row = conn.execute(
                        "SELECT w.lease_owner FROM rollout_windows w WHERE w.env_id = %s AND w.lease_owner IS NOT "
                        "NULL AND EXISTS (SELECT 1 FROM rollout_plays p WHERE p.env_id = w.env_id)",
                        (env_id,),
                    ).fetchone()
                    owner = row[0] if row else None
                time.sleep(0.05)
        workers[owner].kill()
        workers[owner].wait(30)
        cluster.procs[f"{owner}-killed"] = cluster.procs.pop(owner)

        cluster.start(
            "learner",
            ["serve", "learner"],
            {
                "SPADE_LEARNER_DEV_MODE": "true",
                "SPADE_LEARNER_QUEUE": json.dumps(queue),
                "SPADE_LEARNER_MEMORY__TARGET": memory,
                "SPADE_LEARNER_INFERENCE_URLS": json.dumps([inference_url]),
                "SPADE_LEARNER_CHECKPOINT_DIR": str(tmp_path / "checkpoints"),
                "SPADE_LEARNER_WEIGHTS_DIR": str(tmp_path / "weights"),
                "SPADE_LEARNER_AGENT_GROUPS_PER_STEP": "1",
                "SPADE_LEARNER_LR": "1e-4",
                "SPADE_LEARNER_DEVICE": "cpu",
            },
        )
        cluster.start(
            "designer",
            ["serve", "designer"],
            {
                "SPADE_DESIGNER_DEV_MODE": "true",
                "SPADE_DESIGNER_QUEUE": json.dumps(queue),
                "SPADE_DESIGNER_SANDBOX__TARGET": f"127.0.0.1:{ports['sb_grpc']}",
                "SPADE_DESIGNER_SANDBOX__API_KEY": SANDBOX_KEY,
                "SPADE_DESIGNER_MEMORY__TARGET": memory,
                "SPADE_DESIGNER_INFERENCE_URLS": json.dumps([inference_url]),
                "SPADE_DESIGNER_MAX_ATTEMPTS_PER_ENV": "1",
                "SPADE_DESIGNER_MAX_PROMPT_TOKENS": "1536",
            },
        )

        # The survivor plays the env, the learner trains and publishes version 1.
        published = queues_pb2.WeightsPublished.FromString(_next_message(WEIGHTS_PUBLISHED, queue, cluster, 600))
        assert published.weight_version == 1 and published.workers_ok and not published.workers_failed

        with psycopg.connect(database.replace("+psycopg", "")) as conn:
            recorded = conn.execute(
                "SELECT seed, hinted, weight_version, trajectory_id FROM plays WHERE env_id = %s", (env_id,)
            ).fetchall()
        first = [row for row in recorded if row[2] == 0]
        unhinted = sorted(row[0] for row in first if not row[1])
        hinted = sorted(row[0] for row in first if row[1])
        assert len(unhinted) == G and unhinted == hinted, "each seed must be played once in each arm"
        assert len({row[3] for row in recorded}) == len(recorded)

        sample = queues_pb2.DesignerSample.FromString(_next_message(SAMPLES_DESIGNER, queue, cluster, 300))
        assert sample.prompt_ids and sample.output_ids and len(sample.output_logprobs) == len(sample.output_ids)
        cluster.check_alive()
    finally:
        cluster.stop()
        for key in r.scan_iter(f"{prefix}*"):
            r.delete(key)


# --- the learner: a designer sample scored across a version drift (issue 10) -------------------------

DRIFT_SPEC = {
    "temperature": 1.0,
    "group_size": 4,
    "window_versions_game": 1,
    "window_versions_tool": 1,
    "agent_max_turns": 3,
    "agent_max_tokens_per_turn": 16,
    "agent_max_total_tokens": 2048,
    "designer_max_new_tokens": 64,
    "envs_per_round": 1,
    "skills_per_round": 1,
}


def _warmup_group(spec_id: str) -> list[queues_pb2.AgentSample]:
    """Four plays of a made-up env with varying returns: a learner step's worth, so it publishes v1."""
    out = []
    for seed, ret in enumerate([1.0, 0.0, 0.5, 0.0]):
        tokens = [1, 5, 9, 13, 17, 21, 25, 29]
        out.append(
            queues_pb2.AgentSample(
                sample_id=f"warmup@s0/plain/{seed}",
                env_id="warmup",
                setting="game",
                skill="Optimization",
                seed=seed,
                group_id="warmup@s0",
                token_ids=tokens,
                logprobs=[0.0, 0.0, 0.0, -2.0, -2.5, -3.0, -1.5, -2.0],
                loss_mask=[False, False, False, True, True, True, True, True],
                episode_return=ret,
                turns=1,
                weight_version=0,
                finish_reason="terminated",
                spec_id=spec_id,
                window_start=0,
                window_index=0,
            )
        )
    return out


def test_a_designer_sample_is_scored_when_the_learner_published_between_design_and_first_play(
    tmp_path: Path, database: str
) -> None:
    """Design at version 0; the learner publishes v1; only then does the rollout first play the env (its
    window starts at 1). The designer sample is still scored, with regret and plateau from those plays:
    the learner stores exactly what spade.signal gives on the plays the memory recorded."""
    from spade import signal as spade_signal
    from spade.queues.base import SAMPLES_AGENT

    prefix = f"e2e-drift-{uuid.uuid4().hex[:8]}:"
    ports = {name: _free_port() for name in ("sb_grpc", "sb_http", "mem_grpc", "mem_rest", "inference")}
    memory = f"127.0.0.1:{ports['mem_grpc']}"
    inference_url = f"http://127.0.0.1:{ports['inference']}"
    queue = {"kind": "redis", "url": REDIS_URL, "prefix": prefix}
    pool = tmp_path / "pool"
    pool.mkdir()
    # A short game (three turns, graded returns) the pool designer stores as a valid env.
    answer = ROOT / "tests" / "fixtures" / "designer_pool" / "game" / "valid-number_hunt.md"
    (pool / answer.name).write_text(answer.read_text())
    cluster = Cluster(tmp_path)
    r = redis.Redis.from_url(REDIS_URL)
    try:
        cluster.start(
            "sandbox",
            ["serve", "sandbox", "--grpc-port", str(ports["sb_grpc"]), "--http-port", str(ports["sb_http"])],
            {"SPADE_SANDBOX_API_KEYS": json.dumps([{"tenant": "e2e", "key_sha256": hash_key(SANDBOX_KEY)}])},
        )
        cluster.start(
            "memory",
            ["serve", "memory"],
            {
                "SPADE_MEMORY_DEV_MODE": "true",
                "SPADE_MEMORY_DATABASE_URL": database,
                "SPADE_MEMORY_GRPC__HOST": "127.0.0.1",
                "SPADE_MEMORY_GRPC__PORT": str(ports["mem_grpc"]),
                "SPADE_MEMORY_HTTP__PORT": str(ports["mem_rest"]),
            },
        )
        cluster.start("inference", ["serve", "inference", "--port", str(ports["inference"])], {})
        for port in ports.values():
            _wait_port(port, cluster)
        spec = _store_run_spec(DRIFT_SPEC, memory, tmp_path)

        async def observe() -> None:
            observer = RedisStreamQueue(RedisQueueConfig.model_validate(queue))
            for watched in (WEIGHTS_PUBLISHED, SAMPLES_DESIGNER):
                await observer.consume(watched, "e2e-observer", "test", block_ms=1)
            await observer.close()

        asyncio.run(observe())
        cluster.start(
            "learner",
            ["serve", "learner"],
            {
                "SPADE_LEARNER_DEV_MODE": "true",
                "SPADE_LEARNER_QUEUE": json.dumps(queue),
                "SPADE_LEARNER_MEMORY__TARGET": memory,
                "SPADE_LEARNER_INFERENCE_URLS": json.dumps([inference_url]),
                "SPADE_LEARNER_CHECKPOINT_DIR": str(tmp_path / "checkpoints"),
                "SPADE_LEARNER_WEIGHTS_DIR": str(tmp_path / "weights"),
                "SPADE_LEARNER_AGENT_GROUPS_PER_STEP": "1",
                "SPADE_LEARNER_FILL_TIMEOUT_S": "2",
                "SPADE_LEARNER_LR": "1e-4",
                "SPADE_LEARNER_DEVICE": "cpu",
            },
        )
        cluster.start(
            "designer",
            ["serve", "designer", "--pool", str(pool)],
            {
                "SPADE_DESIGNER_DEV_MODE": "true",
                "SPADE_DESIGNER_QUEUE": json.dumps(queue),
                "SPADE_DESIGNER_SANDBOX__TARGET": f"127.0.0.1:{ports['sb_grpc']}",
                "SPADE_DESIGNER_SANDBOX__API_KEY": SANDBOX_KEY,
                "SPADE_DESIGNER_MEMORY__TARGET": memory,
                "SPADE_DESIGNER_INFERENCE_URLS": json.dumps([inference_url]),
            },
        )

        # 1. The design, at version 0.
        design = queues_pb2.DesignerSample.FromString(_next_message(SAMPLES_DESIGNER, queue, cluster, 600))
        assert design.valid and design.env_id and design.weight_version == 0 and design.spec_id == spec.spec_id

        # 2. The learner publishes v1 before anyone plays the env.
        async def warm_up() -> None:
            producer = RedisStreamQueue(RedisQueueConfig.model_validate(queue))
            for sample in _warmup_group(spec.spec_id):
                await producer.publish(SAMPLES_AGENT, sample.SerializeToString(), key=sample.sample_id)
            await producer.close()

        asyncio.run(warm_up())
        published = queues_pb2.WeightsPublished.FromString(_next_message(WEIGHTS_PUBLISHED, queue, cluster, 600))
        assert published.weight_version == 1 and published.spec_id == spec.spec_id and published.workers_ok

        # 3. Only now a rollout worker plays it: its window starts at version 1, not at the design's 0.
        cluster.start(
            "rollout",
            ["serve", "rollout"],
            {
                "SPADE_ROLLOUT_QUEUE": json.dumps(queue),
                "SPADE_ROLLOUT_SANDBOX": json.dumps(
                    {"kind": "grpc", "target": f"127.0.0.1:{ports['sb_grpc']}", "api_key": SANDBOX_KEY}
                ),
                "SPADE_ROLLOUT_MEMORY": json.dumps({"kind": "grpc", "target": memory}),
                "SPADE_ROLLOUT_INFERENCE_URLS": json.dumps([inference_url]),
                "SPADE_ROLLOUT_STATE_URL": database,
                "SPADE_ROLLOUT_CONSUMER_NAME": "rollout-drift",
                "SPADE_ROLLOUT_BLOCK_MS": "200",
            },
        )

        # 4. The learner scores the designer sample from those plays and stores its reward in the memory.
        deadline = time.monotonic() + 900
        with psycopg.connect(database.replace("+psycopg", "")) as conn:
            while True:
                cluster.check_alive()
                row = conn.execute(
                    "SELECT e.window_start, e.weight_version, s.reward_components, s.regret, s.win_rate "
                    "FROM environments e JOIN env_stats s ON s.env_id = e.id WHERE e.id = %s",
                    (design.env_id,),
                ).fetchone()
                conn.commit()
                if row is not None and row[2] and "blend" in row[2]:
                    break
                assert time.monotonic() < deadline, f"the designer sample was never scored\n{cluster.logs()}"
                time.sleep(1.0)
            window_start, designed_at, components, stored_regret, stored_rate = row
            plays = conn.execute(
                "SELECT seed, hinted, episode_return, window_index, finish_reason FROM plays WHERE env_id = %s",
                (design.env_id,),
            ).fetchall()
        assert designed_at == 0 and window_start == 1, "the env's window must start after the publish"
        slot0 = [p for p in plays if p[3] == 0]

        def counted(p: tuple[Any, ...]) -> float:
            return 0.0 if str(p[4]).startswith("fault_") else float(p[2])

        hinted = [(p[0], counted(p)) for p in slot0 if p[1]]
        regret = spade_signal.regret(hinted, [(p[0], counted(p)) for p in slot0 if not p[1]])
        rate = spade_signal.win_rate([counted(p) for p in slot0 if not p[1]])
        assert (stored_regret, stored_rate) == pytest.approx((regret, rate))  # the memory's own statistics
        expected = spade_signal.designer_blend(regret, rate, config=spec.rewards.to_config())
        assert len(slot0) == 2 * spec.group_size
        assert components["regret"] == pytest.approx(regret) and components["window_win_rate"] == pytest.approx(rate)
        assert components["plateau"] == pytest.approx(expected.plateau)
        assert components["blend"] == pytest.approx(expected.blend)
        assert "designer_unscored" not in (tmp_path / "learner.log").read_text()
        cluster.check_alive()
    finally:
        cluster.stop()
        for key in r.scan_iter(f"{prefix}*"):
            r.delete(key)
