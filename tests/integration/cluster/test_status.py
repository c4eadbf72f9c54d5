"""``spade cluster status``: each figure read from real state the test sets up where the services keep it.

Postgres (the memory's tables and the rollout's state tables, in a schema of the test's own), Redis
(streams under a prefix of the test's own, with a consumer group behind), the learner's files (the
``latest`` pointer, its announcement record, its buffer record) and a data directory of known sizes.
No service runs: ``tests/e2e/test_cluster_status.py`` drives the same command through a live cluster.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from click.testing import CliRunner

from services.cluster.cli import cluster
from services.cluster.status import StatusReader
from services.learner.buffer import LearnerBuffer, write_buffer
from services.learner.latest import point_latest
from services.memory.store.sql import SqlStore, make_engine, migrate
from services.rollout.core.schedule import ActiveEnv
from services.rollout.state_store import RolloutStateStore, rollout_windows
from spade.envs.types import Setting
from spade.memory.records import DesignerAttempt, NewEnvironment, Play
from spade.queues.base import SAMPLES_AGENT, WEIGHTS_PUBLISHED
from spade.queues.config import RedisQueueConfig
from spade.queues.redis_streams import RedisStreamQueue
from tests.conftest import POSTGRES_URL, REDIS_URL

pytestmark = [pytest.mark.db, pytest.mark.redis]


@pytest.fixture
def database() -> Iterator[str]:
    """A Postgres URL whose search path is a fresh schema holding the memory's migrated tables."""
    schema = f"status_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    url = f"{POSTGRES_URL}?options=-csearch_path%3D{schema}"
    engine = make_engine(url)
    migrate(engine)
    engine.dispose()
    try:
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


@pytest.fixture
def prefix() -> Iterator[str]:
    name = f"status-{uuid.uuid4().hex[:8]}:"
    yield name
    client = redis.Redis.from_url(REDIS_URL)
    for key in client.scan_iter(f"{name}*"):
        client.delete(key)
    client.close()


def _memory_rows(url: str, now: float) -> None:
    """6 plays and 4 attempts (3 valid) in the 10 minutes before ``now``; 4 plays and 2 attempts before."""
    engine = make_engine(url)
    store = SqlStore(engine)
    env_id = store.put_environment(
        NewEnvironment(setting=Setting.GAME, skill="Optimization", code="class AEnv: pass")
    ).env_id
    recent, old = dt.datetime.fromtimestamp(now - 120, dt.UTC), dt.datetime.fromtimestamp(now - 1800, dt.UTC)
    plays = [
        Play(env_id, seed=i, hinted=False, episode_return=1.0, turns=2, weight_version=1, trajectory_id=f"t{i}",
             played_at=recent if i < 6 else old)
        for i in range(10)
    ]  # fmt: skip
    store.record_plays(plays)
    outcomes = [("valid", recent), ("valid", recent), ("valid", recent), ("malformed", recent)]
    outcomes += [("malformed", old), ("valid", old)]
    store.record_attempts(
        [
            DesignerAttempt(f"d{i}", Setting.GAME, "Optimization", outcome, batch_id="r1", created_at=at)
            for i, (outcome, at) in enumerate(outcomes)
        ]
    )
    engine.dispose()


async def _leases(url: str) -> None:
    """rollout-1 plays slot 0 of e-live under a live lease; rollout-3 (dead) left e-dead's lapsed."""
    store = RolloutStateStore.from_url(url)
    try:
        for env_id in ("e-live", "e-dead"):
            await store.register(
                ActiveEnv(env_id=env_id, setting="game", skill="Optimization", designer_sample_id=f"d-{env_id}",
                          window=3, design_version=0, spec_id="s")
            )  # fmt: skip
        first = await store.claim("rollout-1", 3600.0)  # live for the whole test, however slow the machine
        assert first is not None
        second = await store.claim("rollout-3", 60.0, busy={first.env.env_id})
        assert second is not None and second.env.env_id != first.env.env_id
    finally:
        store.dispose()
    engine = sa.create_engine(url)
    with engine.begin() as conn:  # rollout-3 died: its lease ran out 30 s ago and nobody renewed it
        conn.execute(
            rollout_windows.update()
            .where(rollout_windows.c.lease_owner == "rollout-3")
            .values(lease_until=sa.func.extract("epoch", sa.func.clock_timestamp()) - 30)
        )
    engine.dispose()


async def _streams(prefix: str) -> None:
    """samples.agent: 3 messages, the learner's group read 2 and acknowledged 1 (pending 1, lag 1)."""
    queue = RedisStreamQueue(RedisQueueConfig(url=REDIS_URL, prefix=prefix))
    try:
        await queue.consume(SAMPLES_AGENT, "learner", "learner-0", block_ms=1)  # the group, before any message
        for i in range(3):
            await queue.publish(SAMPLES_AGENT, f"sample {i}".encode(), key=f"k{i}")
        got = await queue.consume(SAMPLES_AGENT, "learner", "learner-0", count=2, block_ms=1)
        assert len(got) == 2
        await queue.ack(SAMPLES_AGENT, "learner", got[0].message_id)
    finally:
        await queue.close()


def _blocks(path: Path, size: int) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(os.urandom(size))
    return path.stat().st_blocks * 512


@pytest.fixture
def cluster_state(tmp_path: Path, database: str, prefix: str) -> dict[str, Any]:
    """Every source of the status set up; returns the environment a cluster's processes would get, the
    expected disk figures and the time the rows are stamped against (now: `spade cluster status` reads
    the real clock, so the stamps must not come from when the module was imported)."""
    now = time.time()
    data = tmp_path / "data"
    checkpoints, weights = data / "learner/checkpoints", data / "learner/weights"
    _memory_rows(database, now)
    asyncio.run(_leases(database))
    asyncio.run(_streams(prefix))
    # The learner published v3 (the pointer moved, the announcement recorded) and holds 5 plays.
    version_dir = weights / "v00000003"
    model = _blocks(version_dir / "model.safetensors", 200_000)
    disk = {
        "journal": _blocks(checkpoints / "journal/00000001.seg", 10_000),
        "weights": model + _blocks(version_dir / "tokenizer.json", 50_000),
        "checkpoints": _blocks(checkpoints / "step-00000003/optimizer.pt", 300_000),
        "logs": _blocks(data / "logs/learner.log", 3_000),
    }
    # The checkpoint of the published version hard-links its model files: counted once, as weights.
    os.link(version_dir / "model.safetensors", checkpoints / "step-00000003/model.safetensors")
    point_latest(weights, version_dir)
    (checkpoints / "published.json").write_text(json.dumps({"version": 3}))
    write_buffer(checkpoints, LearnerBuffer(3, "spec-a", 5, 0, 2, 4, 1, now - 4))
    disk["checkpoints"] += sum((checkpoints / f).stat().st_blocks * 512 for f in ("published.json", "buffer.json"))
    env = {
        "SPADE_LOCAL_DATA_DIR": str(data),
        "SPADE_CLUSTER_RUN_DIR": str(data),
        "SPADE_LEARNER_CHECKPOINT_DIR": str(checkpoints),
        "SPADE_LEARNER_WEIGHTS_DIR": str(weights),
        "SPADE_MEMORY_DATABASE_URL": database,
        "SPADE_ROLLOUT_STATE_URL": database,
        "SPADE_ROLLOUT_QUEUE": json.dumps({"kind": "redis", "url": REDIS_URL, "prefix": prefix}),
    }
    return {"env": env, "disk": disk, "data": data, "latest": weights / "latest", "now": now}


def test_each_figure_is_read_where_it_is_durable(cluster_state: dict[str, Any], prefix: str) -> None:
    env, data, now = cluster_state["env"], cluster_state["data"], cluster_state["now"]
    report = StatusReader(env, data, clock=lambda: now).report(["rollout-1", "rollout-2"], window_min=10)

    # The published version from the `latest` pointer, its time the pointer's own.
    weights = report["weights"]
    assert weights["version"] == 3 and weights["announced"] == 3 and "note" not in weights
    moved = cluster_state["latest"].lstat().st_mtime
    assert weights["published_at"] == dt.datetime.fromtimestamp(moved, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")

    # The learner's buffer against its step: 5 plays of the 2 x 4 a step needs.
    learner = report["learner"]
    assert (learner["plays_buffered"], learner["plays_per_step"], learner["groups_per_step"]) == (5, 8, 2)
    assert learner["age_s"] == 4.0

    # Pending and lag per group exactly as XINFO GROUPS reports them; the key as redis-cli needs it.
    agent = report["streams"][SAMPLES_AGENT]
    assert agent["key"] == f"{prefix}{{samples.agent}}"
    client = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    try:
        (group,) = client.xinfo_groups(agent["key"])
        assert agent["length"] == client.xlen(agent["key"]) == 2  # the acknowledged entry is deleted
    finally:
        client.close()
    assert agent["groups"] == {"learner": {"consumers": 1, "pending": group["pending"], "lag": group["lag"]}}
    assert (group["pending"], group["lag"]) == (1, 1)
    assert report["streams"][WEIGHTS_PUBLISHED] == {"key": f"{prefix}{{weights.published}}", "length": 0, "groups": {}}

    # The last 10 minutes of the memory's rows: 6 plays, 3 of 4 attempts valid.
    activity = report["activity"]
    assert (activity["plays"], activity["plays_per_minute"]) == (6, 0.6)
    assert (activity["designer_valid"], activity["designer_attempts"], activity["designer_validity"]) == (3, 4, 0.75)
    assert activity["designer_outcomes"] == {"valid": 3, "malformed": 1}

    # Each worker's slot from the leases; a dead worker's lapsed lease shows as such.
    rollout = report["rollout"]
    (live,) = rollout["rollout-1"]["slots"]
    assert live["slot"] == 0 and live["lease_expires_in_s"] > 0 and "note" not in live
    assert rollout["rollout-2"] == {"slots": []}
    (dead,) = rollout["rollout-3"]["slots"]
    assert dead["lease_expires_in_s"] < 0 and "lapsed" in dead["note"]
    assert {live["env_id"], dead["env_id"]} == {"e-live", "e-dead"}

    # Disk by part; the checkpoint's hard link to the published model counted once.
    disk = report["disk"]
    assert disk["parts"] == {**cluster_state["disk"], "other": 0}
    assert disk["bytes"] == sum(cluster_state["disk"].values()) and disk["data_dir"] == str(data)


def test_a_source_that_does_not_answer_leaves_the_others(cluster_state: dict[str, Any], tmp_path: Path) -> None:
    env = {
        **cluster_state["env"],
        "SPADE_ROLLOUT_QUEUE": json.dumps({"kind": "redis", "url": "redis://127.0.0.1:1/0", "prefix": "x:"}),
        "SPADE_LEARNER_CHECKPOINT_DIR": str(tmp_path / "nothing"),
    }
    report = StatusReader(env, cluster_state["data"], clock=lambda: cluster_state["now"]).report([], window_min=10)
    assert "ConnectionError" in report["streams"]["error"]
    assert report["learner"] == {
        "note": f"no buffer record yet ({tmp_path / 'nothing/buffer.json'}): the learner has not polled"
    }
    assert report["weights"]["version"] == 3 and report["activity"]["plays"] == 6


def test_a_locked_table_ends_its_section_not_the_report(cluster_state: dict[str, Any]) -> None:
    """A query that would wait on a lock (here another session's ACCESS EXCLUSIVE lock on the rollout's
    table, as a migration or a stalled transaction holds) gives up after the report's database timeout:
    that section says so and the rest still comes, where the command once waited for the lock forever.
    The URL's own options (the test schema's search path) still apply."""
    from services.cluster.status import DB_TIMEOUT_S

    env = cluster_state["env"]
    holder = sa.create_engine(env["SPADE_ROLLOUT_STATE_URL"])
    try:
        with holder.connect() as conn, conn.begin():
            conn.execute(sa.text("LOCK TABLE rollout_windows IN ACCESS EXCLUSIVE MODE"))
            started = time.monotonic()
            report = StatusReader(env, cluster_state["data"], clock=lambda: cluster_state["now"]).report(
                ["rollout-1"], window_min=10
            )
            waited = time.monotonic() - started
    finally:
        holder.dispose()
    assert "statement timeout" in report["rollout"]["error"], report["rollout"]
    assert waited < 10 * DB_TIMEOUT_S, waited  # bounded, not forever (a generous bound on a loaded machine)
    assert report["activity"]["plays"] == 6 and report["weights"]["version"] == 3


def test_status_never_writes_to_a_database_nor_guesses_which_one(cluster_state: dict[str, Any], tmp_path: Path) -> None:
    """A report reads: the rollout's section against an empty database is an error, and the database stays
    empty (no tables created); without the rollout's URL it says so instead of reading the memory's."""
    empty = tmp_path / "empty.db"
    env = {**cluster_state["env"], "SPADE_ROLLOUT_STATE_URL": f"sqlite:///{empty}"}
    reader = StatusReader(env, cluster_state["data"], clock=lambda: cluster_state["now"])
    report = reader.report(["rollout-1"], window_min=10)
    assert "error" in report["rollout"]
    engine = sa.create_engine(f"sqlite:///{empty}")
    try:
        assert sa.inspect(engine).get_table_names() == []
    finally:
        engine.dispose()
    unset = {k: v for k, v in cluster_state["env"].items() if k != "SPADE_ROLLOUT_STATE_URL"}
    report = StatusReader(unset, cluster_state["data"], clock=lambda: cluster_state["now"]).report([], window_min=10)
    assert "SPADE_ROLLOUT_STATE_URL is not set" in report["rollout"]["error"]


def test_the_command_prints_json_and_a_table(cluster_state: dict[str, Any], tmp_path: Path) -> None:
    env_file = tmp_path / "cluster.env"
    lines = {**cluster_state["env"], "SPADE_CLUSTER_SERVICES": "memory,rollout", "SPADE_CLUSTER_ROLLOUT_WORKERS": "2"}
    env_file.write_text("".join(f"{k}={v}\n" for k, v in lines.items() if not k.endswith("_QUEUE")))
    env = {"SPADE_ROLLOUT_QUEUE": cluster_state["env"]["SPADE_ROLLOUT_QUEUE"]}
    runner = CliRunner()
    done = runner.invoke(cluster, ["status", "--json", "--env-file", str(env_file)], env=env, catch_exceptions=False)
    assert done.exit_code == 0, done.output
    report = json.loads(done.output)
    assert report["members"] == {
        "memory": {"pid": None, "health": "down"},
        "rollout-1": {"pid": None, "health": "down"},
        "rollout-2": {"pid": None, "health": "down"},
    }
    assert report["weights"]["version"] == 3 and report["learner"]["plays_buffered"] == 5
    assert report["rollout"]["rollout-1"]["slots"][0]["slot"] == 0
    table = runner.invoke(cluster, ["status", "--env-file", str(env_file)], env=env, catch_exceptions=False)
    assert table.exit_code == 0, table.output
    text = table.output
    assert "weights     v3 published" in text and "announced v3" in text
    assert "5 plays buffered toward 8 a step (0/2 groups of G=4 complete)" in text
    assert "last 10 min: 6 plays (0.6/min), designer 3/4 valid (75%)" in text
    assert f"{report['streams'][SAMPLES_AGENT]['key']}" in text and "learner: 1/1" in text
    assert "rollout-3" in text and "lease lapsed: any worker takes it over" in text
