"""``spade cluster status --json`` through a live cluster: after ``up``, after a publication, after a kill.

The shipped cluster (``cluster_harness``: ``deploy/spade.env`` and ``deploy/local.env`` with a test's
ports, database, queue prefix and data directory), a small run spec so plays are quick on a CPU, the
pool designer (one answer) instead of the model's, and two rollout workers with a short lease, one
slot at a time each. At each point the command's figures are checked against what the services hold:
the ``latest`` pointer, the memory's rows, the rollout's lease rows and what Redis' ``XINFO GROUPS``
answers.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import psycopg
import pytest
import redis

from spade.inference.published import LATEST, published_version
from spade.queues.base import SAMPLES_AGENT, WEIGHTS_PUBLISHED
from spade.queues.config import RedisQueueConfig
from spade.queues.redis_streams import RedisStreamQueue
from spade.runspec import RunSpec
from spade.v1 import queues_pb2
from tests.e2e.cluster_harness import RunnerCluster, next_message, running_cluster, spec_and_pool, warmup_group

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

T = TypeVar("T")

SPEC = {
    "temperature": 1.0,
    "group_size": 4,
    "window_versions_game": 3,
    "window_versions_tool": 1,
    "agent_max_turns": 3,
    "agent_max_tokens_per_turn": 16,
    "agent_max_total_tokens": 2048,
    "designer_max_new_tokens": 64,
    "envs_per_round": 1,
    "skills_per_round": 1,
}


def _wait(found: Callable[[], T | None], what: str, timeout_s: float, cluster: RunnerCluster) -> T:
    deadline = time.monotonic() + timeout_s
    while True:
        value = found()
        if value is not None:
            return value
        cluster.check_alive()
        assert time.monotonic() < deadline, f"{what} within {timeout_s:.0f} s\n{cluster.logs()}"
        time.sleep(1.0)


def _xinfo(cluster: RunnerCluster, key: str) -> dict[str, tuple[int, int | None]]:
    client = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
    try:
        return (
            {g["name"]: (int(g["pending"]), g.get("lag")) for g in client.xinfo_groups(key)}
            if client.exists(key)
            else {}
        )
    finally:
        client.close()


def _sql(cluster: RunnerCluster, query: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(cluster.dsn) as conn:
        return conn.execute(query).fetchall()


def _counts(cluster: RunnerCluster) -> tuple[int, int, int]:
    """Plays in the last 10 minutes, and designer attempts and valid ones, as the memory holds them."""
    window = "now() - interval '10 minutes'"
    ((plays,),) = _sql(cluster, f"SELECT count(*) FROM plays WHERE played_at >= {window}")
    ((attempts, valid),) = _sql(
        cluster,
        "SELECT count(*), count(*) FILTER (WHERE outcome = 'valid') FROM designer_attempts "
        f"WHERE created_at >= {window}",
    )
    return int(plays), int(attempts), int(valid)


def _published_groups(cluster: RunnerCluster) -> dict[str, tuple[int, int | None]]:
    """``weights.published``'s consumer groups as Redis reports them: (pending, lag) by name."""
    return _xinfo(cluster, f"{cluster.prefix}{{{WEIGHTS_PUBLISHED}}}")


def _check_against_stores(
    cluster: RunnerCluster,
    report: dict[str, Any],
    before: tuple[int, int, int],
    groups_before: dict[str, tuple[int, int | None]],
) -> None:
    """The report's streams, activity and disk against Redis, the memory's rows and the data directory.

    ``before`` and ``groups_before`` are the memory's counts and Redis' groups read just before the
    report: what the report shows must lie between them and what the stores hold after it.
    """
    after = _counts(cluster)
    activity = report["activity"]
    assert before[0] <= activity["plays"] <= after[0], (before, activity, after)
    assert before[1] <= activity["designer_attempts"] <= after[1], (before, activity, after)
    assert before[2] <= activity["designer_valid"] <= after[2], (before, activity, after)
    for stream, figures in report["streams"].items():
        assert figures["key"] == f"{cluster.prefix}{{{stream}}}"
    # weights.published moves only at a publication: its groups' figures are exactly Redis', as Redis
    # reported them just before or just after the report (a publication may fall in between: CI saw
    # the observer's lag go 0 -> 1 under load).
    shown = {g: (v["pending"], v["lag"]) for g, v in report["streams"][WEIGHTS_PUBLISHED]["groups"].items()}
    # A service may create its group between the report and this look (they do at start): every group
    # the report shows is Redis' with Redis' figures, and the test's own group is among them.
    in_redis = _published_groups(cluster)
    assert "e2e-observer" in shown and set(shown) <= set(in_redis), (shown, in_redis)
    assert all(shown[g] in (groups_before.get(g), in_redis[g]) for g in shown), (groups_before, shown, in_redis)
    disk = report["disk"]
    assert disk["data_dir"] == str(cluster.environ["SPADE_LOCAL_DATA_DIR"]) and disk["parts"]["logs"] > 0


def test_status_through_up_a_publication_and_a_kill(tmp_path: Path) -> None:
    spec = RunSpec.model_validate(SPEC)
    spec_file, pool = spec_and_pool(tmp_path, spec)
    with running_cluster(
        tmp_path,
        SPADE_CLUSTER_ROLLOUT_WORKERS="2",
        SPADE_CLUSTER_RUN_SPEC=str(spec_file),
        SPADE_DESIGNER_POOL_DIR=str(pool),
        SPADE_ROLLOUT_LEASE_S="6",
        SPADE_ROLLOUT_MAX_CONCURRENT_ENVS="1",
    ) as cluster:
        cluster.up()
        weights_dir = Path(cluster.environ["SPADE_LOCAL_DATA_DIR"]) / "learner" / "weights"

        # 1. Up: every member up; the figures as the stores hold them.
        before, groups = _counts(cluster), _published_groups(cluster)
        report = cluster.status()
        assert {name: m["health"] for name, m in report["members"].items()} == dict.fromkeys(cluster.names, "up")
        assert report["weights"]["version"] == published_version(weights_dir)
        assert set(report["rollout"]) >= {"rollout-1", "rollout-2"}
        _check_against_stores(cluster, report, before, groups)

        # 2. A publication: the version and its time from the `latest` pointer, the learner's buffer after it.
        # A group with varied returns makes sure a step trains (the 135M model's own plays may all
        # score 0: a group without signal trains nothing).
        async def warm_up() -> None:
            producer = RedisStreamQueue(RedisQueueConfig.model_validate(cluster.queue))
            for sample in warmup_group(spec.spec_id):
                await producer.publish(SAMPLES_AGENT, sample.SerializeToString(), key=sample.sample_id)
            await producer.close()

        asyncio.run(warm_up())
        message = queues_pb2.WeightsPublished.FromString(next_message(WEIGHTS_PUBLISHED, cluster, 900))
        assert message.weight_version == 1
        before, groups = _counts(cluster), _published_groups(cluster)
        version, report = published_version(weights_dir), cluster.status()
        if published_version(weights_dir) == version:  # no second publication in between
            weights = report["weights"]
            moved = (weights_dir / LATEST).lstat().st_mtime
            assert weights["version"] == version >= 1 and weights["announced"] >= 1
            assert weights["published_at"] == dt.datetime.fromtimestamp(moved, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        learner = report["learner"]
        assert learner["version"] >= 1 and learner["group_size"] == spec.group_size, learner
        assert learner["plays_per_step"] == learner["groups_per_step"] * spec.group_size
        # The test's observer group read v1 and never acknowledged it: pending 1, as Redis says.
        assert report["streams"][WEIGHTS_PUBLISHED]["groups"]["e2e-observer"]["pending"] == 1
        assert report["disk"]["parts"]["weights"] > 0 and report["disk"]["parts"]["checkpoints"] > 0
        _check_against_stores(cluster, report, before, groups)

        # 3. A kill: the worker holding a slot dies; status shows it down with the slot it held (the
        # lease row), then the other worker takes the slot over and says whose it took.
        leases = "SELECT lease_owner, env_id FROM rollout_windows WHERE lease_owner IS NOT NULL AND status = 'active'"

        def frozen_holder() -> tuple[str, set[tuple[str, str]]] | None:
            """A worker stopped (SIGSTOP) while its lease row says it holds a slot: it cannot finish the
            slot between the look and the kill. Each worker is stopped first and looked at after, so a
            slot that is held only briefly (plays are fast) is still caught; one holding none goes on."""
            members = cluster.status()["members"]
            for name in ("rollout-1", "rollout-2"):
                pid = members[name]["pid"]
                if pid is None:
                    continue
                os.kill(pid, signal.SIGSTOP)
                held = {(str(o), str(e)) for o, e in _sql(cluster, leases)}
                if any(owner == name for owner, _ in held):
                    return name, held
                os.kill(pid, signal.SIGCONT)
            return None

        victim, held_before = _wait(frozen_holder, "no rollout worker was caught holding a slot", 600, cluster)
        survivor = "rollout-2" if victim == "rollout-1" else "rollout-1"
        cluster.kill(victim)
        report = cluster.status()
        held_after = {(str(o), str(e)) for o, e in _sql(cluster, leases)}
        assert report["members"][victim] == {"pid": None, "health": "down"}
        shown = {(owner, s["env_id"]) for owner, w in report["rollout"].items() for s in w["slots"]}
        assert shown in (held_before, held_after), (shown, held_before, held_after)

        def took_over() -> dict[str, Any] | None:
            for line in cluster.runner.log_tail(survivor, 10**9).splitlines():
                if '"event": "took_over"' in line:
                    record: dict[str, Any] = json.loads(line)
                    return record
            return None

        said = _wait(took_over, f"{survivor} never took {victim}'s slot over", 300, cluster)
        assert said["from_owner"] == victim and said["level"] == "info" and said["reason"] == "lease lapsed"
        assert said["env_id"] in {env for owner, env in held_before if owner == victim}, (said, held_before)
        report = cluster.status()
        assert all(s["env_id"] != said["env_id"] for s in report["rollout"][victim]["slots"])

        # Every service said it started, at info level, through the one lifecycle logger.
        for name in cluster.names:
            lines = [json.loads(x) for x in cluster.runner.log_tail(name, 10**9).splitlines() if x.startswith("{")]
            started = [x for x in lines if x.get("event") == "started"]
            assert started and started[0]["level"] == "info" and started[0]["logger"] == "spade.serving.lifecycle", name

        # Down: each member that exited within the grace says `stopped` naming SIGTERM.
        down = cluster.spade("cluster", "down").stderr
        for name in cluster.names:
            if name == victim or f"cluster: {name} ignored SIGTERM" in down:
                continue
            lines = [json.loads(x) for x in cluster.runner.log_tail(name, 10**9).splitlines() if x.startswith("{")]
            stopped = [x for x in lines if x.get("event") == "stopped"]
            assert stopped and stopped[-1]["signal"] == "SIGTERM", (name, lines[-5:])
