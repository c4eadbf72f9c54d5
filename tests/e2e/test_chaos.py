"""Chaos over the distributed stack (issue 13): every service killed once mid-work, Redis and
Postgres restarted once each, and nothing lost, nothing twice.

The system is the one ``spade cluster up`` runs from the shipped env files (``cluster_harness``),
on a Redis and a Postgres of the test's own (the machine's shared ones serve other tests and are
never touched): a ``redis-server`` with an append-only file, a Postgres cluster made by ``initdb``
in a tmp directory, each restarted on its port and data directory. The faults, each followed by
``spade cluster up`` (which starts only the dead):

0. ``kill -9`` of the designer in its first round;
1. once the learner has published v1, while a rollout worker plays a slot: ``kill -9`` of the
   sandbox its plays hold sessions in; then of the inference server and the memory they use;
2. while a worker plays the slot again and the learner holds plays its last checkpoint lacks (in its
   journal): ``kill -9`` of the learner and of that worker; the learner must resume at its last
   checkpoint's version and replay exactly that journal;
3. while a worker plays: Redis stopped and started, then Postgres; no ``up``: the services must ride
   through both.

Then the run must go on (a version newer than every one before the faults is published), no
version may be published twice or skipped, and once designer, rollout workers and learner are
stopped in turn (each finishing its work in hand), the learner must have received exactly the plays
and designer samples the memory recorded, the memory holding none twice. ``-s`` shows the figures.
Nothing in the test is random: the victims are whoever holds the work, and the services seed
their own sampling.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import psycopg
import pytest
import redis

from services.learner.journal import decode
from spade.queues.base import SAMPLES_AGENT, SAMPLES_DESIGNER, WEIGHTS_PUBLISHED
from spade.v1 import queues_pb2
from tests.e2e.cluster_harness import RunnerCluster, free_port, running_cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

T = TypeVar("T")

REDIS_SERVER = shutil.which("redis-server")
PG_CTL = shutil.which("pg_ctl") or next(iter(sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"))), None)
DOWN_S = 2.0
"""How long Redis and Postgres stay down when restarted: a real outage, not a blink."""


def events(log: str, name: str) -> list[dict[str, Any]]:
    """The structured events called ``name`` in a service's JSON log (``spade.serving.logs.log_event``)."""
    found = []
    for line in log.splitlines():
        if line.startswith("{") and f'"event": "{name}"' in line:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a line cut by the tail
                continue
            if record.get("event") == name:
                found.append(record)
    return found


class RedisServer:
    """A ``redis-server`` of the test's own, on a free port, its append-only file in ``directory``
    (so a restart keeps the streams, their consumer groups and the idempotency keys)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        assert REDIS_SERVER is not None
        argv = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory)]
        argv += ["--appendonly", "yes", "--save", "", "--logfile", str(self.directory / "redis.log")]
        self._proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url, socket_timeout=1)
        try:
            _wait(lambda: _answers(client.ping), "redis-server to answer", 30)
        finally:
            client.close()

    def stop(self) -> None:
        """SIGTERM: Redis writes its append-only file out and exits."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(10)


class PostgresServer:
    """A Postgres cluster of the test's own (``initdb``, trust auth), on a free port.

    Its directory is made with :func:`tempfile.mkdtemp`, not under pytest's tmp (mode 0700 of
    root): as root, the server runs as the ``postgres`` user, who must reach it.
    """

    def __init__(self) -> None:
        assert PG_CTL is not None
        self.bin = Path(PG_CTL).resolve().parent
        self.directory = Path(tempfile.mkdtemp(prefix="spade-chaos-pg-"))
        self.port = free_port()
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}"
        self._as = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        try:
            if self._as:
                shutil.chown(self.directory, "postgres")
            self._run("initdb", "-D", str(self.directory / "data"), "-A", "trust", "-U", "postgres", "--no-sync")
        except BaseException:
            shutil.rmtree(self.directory, ignore_errors=True)
            raise

    def _run(self, tool: str, *args: str) -> None:
        done = subprocess.run(
            [*self._as, str(self.bin / tool), *args], capture_output=True, text=True, timeout=120, check=False
        )
        assert done.returncode == 0, f"{tool} {' '.join(args)} exited {done.returncode}:\n{done.stdout}{done.stderr}"

    def start(self) -> None:
        options = f"-p {self.port} -k {self.directory} -c listen_addresses=127.0.0.1 -c fsync=off"
        data, log = str(self.directory / "data"), str(self.directory / "log")
        self._run("pg_ctl", "-D", data, "-l", log, "-w", "-o", options, "start")

    def stop(self, mode: str = "fast") -> None:
        """Stop the server: ``fast`` ends every client's connection (the chaos), ``immediate`` at the end."""
        self._run("pg_ctl", "-D", str(self.directory / "data"), "-m", mode, "-w", "stop")

    def remove(self) -> None:
        if (self.directory / "data" / "postmaster.pid").exists():
            self.stop("immediate")
        shutil.rmtree(self.directory, ignore_errors=True)


@pytest.fixture
def stores(tmp_path: Path) -> Iterator[tuple[RedisServer, PostgresServer]]:
    """The test's own Redis and Postgres, running; both stopped and removed afterwards, whatever happens."""
    if REDIS_SERVER is None or PG_CTL is None:
        pytest.skip("the chaos test runs a redis-server and a Postgres (pg_ctl, initdb) of its own: install both")
    (tmp_path / "redis").mkdir()
    redis_server = RedisServer(tmp_path / "redis")
    postgres: PostgresServer | None = None
    try:
        redis_server.start()
        postgres = PostgresServer()
        postgres.start()
        yield redis_server, postgres
    finally:
        redis_server.stop()
        if postgres is not None:
            postgres.remove()


def _answers(call: Callable[[], object]) -> bool:
    try:
        call()
    except (redis.RedisError, OSError):
        return False
    return True


def _wait(found: Callable[[], T | None], what: str, timeout_s: float, cluster: RunnerCluster | None = None) -> T:
    """Poll ``found`` until it gives a value other than ``None``/``False``/empty; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        if cluster is not None:
            cluster.check_alive()
        value = found()
        if value:
            return value
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:.0f} s" + (
            f"\n{cluster.logs()}" if cluster else ""
        )
        time.sleep(0.5)


# --- what the test reads: the streams, the database, the learner's files ------------------------------


def _stream(cluster: RunnerCluster, name: str) -> str:
    return f"{cluster.prefix}{{{name}}}"


def published(cluster: RunnerCluster) -> list[int]:
    """Every weight version announced on ``weights.published``, in order (the test's consumer group
    never acknowledges them, so the stream keeps them all)."""
    client = redis.Redis.from_url(cluster.redis_url, socket_timeout=5)
    try:
        entries: list[tuple[bytes, dict[bytes, bytes]]] = client.xrange(_stream(cluster, WEIGHTS_PUBLISHED))  # type: ignore[assignment]
    except redis.ConnectionError:
        return []
    finally:
        client.close()
    return [queues_pb2.WeightsPublished.FromString(fields[b"d"]).weight_version for _, fields in entries]


def learner_caught_up(cluster: RunnerCluster) -> bool:
    """Whether the learner's group has read and acknowledged everything on both sample streams."""
    client = redis.Redis.from_url(cluster.redis_url, socket_timeout=5)
    try:
        for name in (SAMPLES_AGENT, SAMPLES_DESIGNER):
            key = _stream(cluster, name)
            if not client.exists(key):
                continue
            last = client.xinfo_stream(key)["last-generated-id"]
            group = next((g for g in client.xinfo_groups(key) if g["name"] == b"learner"), None)
            if group is None or group["pending"] or group["last-delivered-id"] != last:
                return False
        return True
    finally:
        client.close()


def plays_done(cluster: RunnerCluster) -> int:
    """How many plays the rollout workers have finished (published, recorded and marked done)."""
    with psycopg.connect(cluster.dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM rollout_plays").fetchone()
    return int(row[0]) if row else 0


def playing(cluster: RunnerCluster, after: int = 0) -> str | None:
    """The rollout worker playing a slot now: it holds the slot's live lease, one of the slot's plays is
    done already, so the others are in flight, and more than ``after`` plays are done in all (a lease
    a killed worker left behind looks live until it lapses; finished plays show someone is at work)."""
    with psycopg.connect(cluster.dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT w.lease_owner FROM rollout_windows w WHERE w.lease_owner IS NOT NULL "
            "AND w.lease_until > extract(epoch FROM clock_timestamp()) "
            "AND EXISTS (SELECT 1 FROM rollout_plays p WHERE p.env_id = w.env_id AND p.slot = w.slots_done) "
            "AND (SELECT count(*) FROM rollout_plays) > %s",
            (after,),
        ).fetchone()
    return str(row[0]) if row else None


def designing(cluster: RunnerCluster) -> bool:
    """Whether the designer is in the middle of its first round (its corpus is loaded, the round not logged)."""
    log = cluster.runner.log_tail("designer", 10**9).rsplit("===== spade cluster: starting designer", 1)[-1]
    return "corpus " in log and "designer round " not in log


class LearnerFiles:
    """The learner's checkpoints, its sample journal and its state file (``SPADE_LEARNER_CHECKPOINT_DIR``)."""

    def __init__(self, cluster: RunnerCluster) -> None:
        self.root = Path(cluster.runner.value("SPADE_LEARNER_CHECKPOINT_DIR", ""))
        assert self.root.is_absolute(), self.root

    def last_checkpoint(self) -> int | None:
        steps = sorted(int(p.name.removeprefix("step-")) for p in self.root.glob("step-*"))
        return steps[-1] if steps else None

    def checkpoint_state(self, step: int) -> dict[str, Any]:
        state: dict[str, Any] = json.loads((self.root / f"step-{step:08d}" / "state.json").read_text())
        return state

    def unsaved_messages(self) -> int:
        """Samples received since the last checkpoint, waiting in the journal (what a restart replays)."""
        step = self.last_checkpoint()
        if step is None:
            return 0
        since = int(self.checkpoint_state(step).get("journal_from", 0))
        segments = [p for p in self.root.glob("journal/segment-*.log") if int(p.stem[len("segment-") :]) >= since]
        return sum(_records(p) for p in segments)

    def totals(self) -> dict[str, int]:
        state = json.loads((self.root / "learner_state.json").read_text())
        return {k: int(v) for k, v in state["totals"].items()}


def _records(segment: Path) -> int:
    try:
        return sum(1 for _ in decode(segment.read_bytes()))
    except FileNotFoundError:  # a checkpoint discarded it meanwhile
        return 0


def recorded(cluster: RunnerCluster) -> dict[str, int]:
    """What the memory recorded: plays and designer samples, and how many of each it holds twice."""
    with psycopg.connect(cluster.dsn, autocommit=True) as conn:

        def one(sql: str) -> int:
            row = conn.execute(sql).fetchone()
            return int(row[0]) if row else 0

        return {
            "plays": one("SELECT count(*) FROM plays"),
            "plays twice": one(
                "SELECT coalesce(sum(n - 1), 0) FROM (SELECT count(*) AS n FROM plays "
                "GROUP BY env_id, window_index, seed, hinted) AS g"
            ),
            "designer samples": one("SELECT count(*) FROM designer_attempts"),
            "designer samples twice": one(
                "SELECT coalesce(sum(n - 1), 0) FROM (SELECT count(*) AS n FROM designer_attempts "
                "GROUP BY sample_id) AS g"
            ),
        }


# --- the test -------------------------------------------------------------------------------------------


def test_every_service_killed_and_both_stores_restarted_lose_nothing_and_repeat_nothing(
    tmp_path: Path, stores: tuple[RedisServer, PostgresServer]
) -> None:
    redis_server, postgres = stores
    started = time.monotonic()
    faults: list[str] = []

    def fault(what: str) -> None:
        faults.append(f"{what} at {time.monotonic() - started:.0f} s")

    with running_cluster(
        tmp_path,
        redis_url=redis_server.url,
        postgres=postgres.url,
        clean=False,  # the servers go with the test
        SPADE_ROLLOUT_SHUTDOWN_GRACE_S="300",  # a stopped worker finishes its slot: nothing left half-kept
    ) as cluster:
        cluster.up()
        learner = LearnerFiles(cluster)

        # 0. The designer in its first round (generating), before anything is published.
        _wait(lambda: designing(cluster), "designer round under way", 600, cluster)
        cluster.kill("designer")
        fault("kill -9 designer (mid-round)")
        cluster.up()
        _wait(lambda: published(cluster), "weight version 1", 900, cluster)
        before = max(published(cluster))

        # 1. Mid-play (a slot of v1 under way): the sandbox holding its plays' sessions; once it is back,
        # the inference server generating their turns and the memory recording them.
        _wait(lambda: playing(cluster), "rollout worker playing a slot", 600, cluster)
        cluster.kill("sandbox")
        fault("kill -9 sandbox (mid-play)")
        done = plays_done(cluster)
        cluster.up()
        _wait(lambda: playing(cluster, after=done), "rollout worker playing after the sandbox restart", 600, cluster)
        for name in ("inference", "memory"):
            cluster.kill(name)
            fault(f"kill -9 {name} (mid-play)")
        done = plays_done(cluster)
        cluster.up()

        # 2. Mid-play again (the slot tried anew): its player, and the learner holding samples its last
        # checkpoint lacks (in its journal).
        owner = _wait(lambda: playing(cluster, after=done), "rollout worker playing a slot again", 600, cluster)
        _wait(learner.unsaved_messages, "samples received since the learner's last checkpoint", 600, cluster)
        cluster.kill("learner")
        fault("kill -9 learner (mid-fill)")
        cluster.kill(owner)
        fault(f"kill -9 {owner} (mid-play)")
        resume_at, replay = learner.last_checkpoint(), learner.unsaved_messages()
        done = plays_done(cluster)
        cluster.up()

        # 3. The stores, each down for a moment and back on its port and data, mid-play; no `up` now.
        _wait(lambda: playing(cluster, after=done), "rollout worker playing after the restarts", 600, cluster)
        redis_server.stop()
        time.sleep(DOWN_S)
        redis_server.start()
        fault("restart redis (mid-play)")
        postgres.stop()
        time.sleep(DOWN_S)
        postgres.start()
        fault("restart postgres (mid-play)")

        # The run goes on: a version newer than any before the last fault.
        last_before = max(published(cluster))
        _wait(lambda: max(published(cluster), default=0) > last_before, "weight version after the faults", 900, cluster)

        # Stop the producers (each finishing its work in hand), let the learner read the rest, stop it.
        for name in ("designer", "rollout-1", "rollout-2"):
            cluster.kill(name, "TERM", wait_s=400)
        _wait(lambda: learner_caught_up(cluster), "learner reading every sample", 300, cluster)
        cluster.kill("learner", "TERM", wait_s=300)

        versions = published(cluster)
        totals = learner.totals()
        memory = recorded(cluster)
        learner_log = cluster.runner.log_tail("learner", 10**9)
        rollout_log = "".join(cluster.runner.log_tail(f"rollout-{i}", 10**9) for i in (1, 2))
        figures = {
            "faults injected": len(faults),
            "faults": faults,
            "version before the faults": before,
            "version after": max(versions),
            "learner resumed at": resume_at,
            "journal messages replayed": replay,
            "plays tried again after a sandbox fault": len(
                re.findall(r"playing \S+ seed \d+ failed \(try", rollout_log)
            ),
            "slots failed and tried again": len(events(rollout_log, "slot_failed")),
            # Not asserted (a known gap, outside this test's requirements): a restarted inference server
            # serves the base model until the learner publishes again, so these plays ran on older weights.
            "plays on weights older than their slot": sum(
                int(play["weight_version"]) < int(play["version"]) for play in events(rollout_log, "play")
            ),
            "plays recorded": memory["plays"],
            "plays received by the learner": totals.get("agent_received", 0),
            "designer samples recorded": memory["designer samples"],
            "designer samples received by the learner": totals.get("designer_received", 0),
            "duplicates in the memory": memory["plays twice"] + memory["designer samples twice"],
            "redeliveries the learner dropped": totals.get("duplicates", 0),
            "lost": abs(memory["plays"] - totals.get("agent_received", 0))
            + abs(memory["designer samples"] - totals.get("designer_received", 0)),
            "seconds": round(time.monotonic() - started),
        }
        print("chaos figures:", json.dumps(figures, indent=2))

        # The learner came back at its last checkpoint, with what it had received since, and went on
        # from there: no version published twice, none skipped.
        assert re.findall(r"resumed from \S+ at weight version (\d+)", learner_log) == [str(resume_at)]
        replayed = re.findall(r"replayed (\d+) messages from the sample journal", learner_log)
        assert replayed == ([str(replay)] if replay else []), (replayed, replay)
        assert versions == list(range(1, len(versions) + 1)), f"a version published twice or skipped: {versions}"
        # Every play and designer sample recorded once, and exactly those received by the learner.
        assert memory["plays twice"] == 0 and memory["designer samples twice"] == 0, memory
        assert memory["plays"] == totals.get("agent_received"), (memory, totals)
        assert memory["designer samples"] == totals.get("designer_received", 0) >= 1, (memory, totals)
        cluster.down()
