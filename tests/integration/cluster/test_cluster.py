"""``spade cluster``: the shipped env files (deploy/spade.env, deploy/local.env) brings the servers up as processes with
generated keys, stores the run spec and loads the seed pool; ``kill`` then ``up`` starts only the
dead member again; ``down`` stops everything. The servers only (sandbox, memory): the workers and the
model are the distributed e2e's (tests/e2e/test_distributed.py)."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis

from services.cluster.envfile import read_env_files
from spade.memory.runspec import load_spec_file
from tests.conftest import REDIS_URL

pytestmark = [pytest.mark.slow, pytest.mark.db, pytest.mark.redis, pytest.mark.sandbox, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[3]
SPADE = [sys.executable, "-m", "spade.cli"]
ADMIN_DSN = "postgresql://postgres@127.0.0.1:5432/test"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def overrides(tmp_path: Path) -> Iterator[dict[str, str]]:
    """Variables that move the shipped cluster onto free ports, a fresh database and queue prefix."""
    database = f"spade_cluster_{uuid.uuid4().hex[:10]}"
    prefix = f"cluster-{uuid.uuid4().hex[:8]}:"
    env = {
        "SPADE_LOCAL_SANDBOX_GRPC_PORT": str(_free_port()),
        "SPADE_LOCAL_SANDBOX_HTTP_PORT": str(_free_port()),
        "SPADE_LOCAL_MEMORY_GRPC_PORT": str(_free_port()),
        "SPADE_LOCAL_MEMORY_HTTP_PORT": str(_free_port()),
        "SPADE_LOCAL_REDIS_URL": REDIS_URL,
        "SPADE_LOCAL_QUEUE_PREFIX": prefix,
        "SPADE_LOCAL_DATABASE_URL": f"postgresql+psycopg://postgres@127.0.0.1:5432/{database}",
        "SPADE_LOCAL_DATA_DIR": str(tmp_path / "cluster"),
        "SPADE_CLUSTER_SERVICES": "sandbox,memory",
        "SPADE_MEMORY_VENDI": "false",
    }
    try:
        yield env
    finally:
        _spade(env, "cluster", "down", check=False)
        with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {database} WITH (FORCE)")
        r = redis.Redis.from_url(REDIS_URL)
        for key in r.scan_iter(f"{prefix}*"):
            r.delete(key)


def _spade(env: dict[str, str], *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    # The CLI's own environment, without the keys a developer's shell may hold: the cluster's win.
    base = {k: v for k, v in os.environ.items() if not k.startswith("SPADE_")}
    done = subprocess.run(
        [*SPADE, *args],
        cwd=ROOT, env={**base, "HF_HUB_OFFLINE": "1", **env}, capture_output=True, text=True, timeout=480, check=False,
    )  # fmt: skip
    if check:
        assert done.returncode == 0, f"spade {' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done


def _status(env: dict[str, str]) -> dict[str, Any]:
    report: dict[str, Any] = json.loads(_spade(env, "cluster", "status", "--json").stdout)
    return report


def test_up_kill_up_down_with_generated_keys(overrides: dict[str, str], tmp_path: Path) -> None:
    up = _spade(overrides, "cluster", "up")
    assert "cluster up" in up.stdout, up.stderr
    spec_id = load_spec_file(ROOT / "deploy" / "runspec.yaml").spec_id
    (spec_line,) = [line for line in up.stderr.splitlines() if line.startswith(f"cluster: run spec {spec_id}, stored")]
    assert "G=" in spec_line and "{" not in spec_line, spec_line  # a short line, no JSON cut off
    assert "cluster: seed pool: 1 game environment stored and announced on envs.ready" in up.stderr
    run_dir = tmp_path / "cluster"
    keys_file = run_dir / "keys.env"
    assert stat.S_IMODE(keys_file.stat().st_mode) == 0o600
    keys = read_env_files([keys_file], {})
    assert len(keys["SPADE_CLUSTER_OPERATOR_KEY"]) >= 32

    # Every server up, each with its own pid; the servers require the generated keys.
    members = _status(overrides)["members"]
    assert set(members) == {"sandbox", "memory"} and all(m["health"] == "up" for m in members.values()), members
    memory = f"127.0.0.1:{overrides['SPADE_LOCAL_MEMORY_GRPC_PORT']}"
    refused = _spade(overrides, "runspec", "show", "--memory", memory, check=False)
    assert refused.returncode != 0, "the memory answered without a key"

    # The run spec of deploy/runspec.yaml is stored, and the seed pool is loaded.
    shown = _spade(
        {**overrides, "SPADE_MEMORY_API_KEY": keys["SPADE_MEMORY_API_KEY"]}, "runspec", "show", "--memory", memory
    )
    assert load_spec_file(ROOT / "deploy" / "runspec.yaml").spec_id in shown.stdout.splitlines()[0]
    dsn = overrides["SPADE_LOCAL_DATABASE_URL"].replace("+psycopg", "")
    with psycopg.connect(dsn) as conn:
        envs = conn.execute("SELECT count(*) FROM environments").fetchone()
    assert envs is not None and envs[0] == 1

    # A killed member is started again by `up`; the others keep their process.
    _spade(overrides, "cluster", "kill", "memory")
    assert _status(overrides)["members"]["memory"]["health"] == "down"
    again = _spade(overrides, "cluster", "up")
    assert "cluster: seed pool: 1 game environment already stored and announced; nothing new" in again.stderr
    after = _status(overrides)["members"]
    assert after["sandbox"]["pid"] == members["sandbox"]["pid"]
    assert after["memory"]["health"] == "up" and after["memory"]["pid"] != members["memory"]["pid"]
    assert read_env_files([keys_file], {}) == keys, "keys are generated once"

    # `down` stops every process, the last started first, each reported as it exits.
    down = [line for line in _spade(overrides, "cluster", "down").stderr.splitlines() if line.startswith("cluster: ")]
    assert down == [
        f"cluster: stopping memory (pid {after['memory']['pid']}): SIGTERM",
        down[1],
        f"cluster: stopping sandbox (pid {after['sandbox']['pid']}): SIGTERM",
        down[3],
    ], down
    assert down[1].startswith("cluster: memory stopped (") and down[3].startswith("cluster: sandbox stopped (")
    assert all(m["pid"] is None for m in _status(overrides)["members"].values())
    for pid in (after["sandbox"]["pid"], after["memory"]["pid"]):
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1][:3]
