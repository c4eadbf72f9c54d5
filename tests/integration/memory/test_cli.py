"""``spade envs`` on a real SQLite memory, and ``spade serve memory`` as a real process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from services.memory.cli import envs
from services.memory.store.sql import SqlStore, make_engine, migrate
from spade.auth import Unauthenticated, hash_key
from spade.memory.client import MemoryClient
from spade.memory.records import EnvStatus, Play
from tests.integration.memory.conftest import new_env


@pytest.fixture
def db(tmp_path: Path) -> tuple[str, dict[str, str]]:
    url = f"sqlite:///{tmp_path / 'mem.db'}"
    engine = make_engine(url)
    migrate(engine)
    store = SqlStore(engine)
    ids = {
        "a": store.put_environment(new_env("Alpha", env_class="AlphaEnv", skill="Optimization")).env_id,
        "b": store.put_environment(new_env("Beta", env_class="BetaEnv", status=EnvStatus.INVALID)).env_id,
    }
    store.record_plays([Play(ids["a"], 4, False, 1.0, 2, 0, "tr-1", "terminated")])
    engine.dispose()
    return url, ids


def test_envs_list_show_export(db: tuple[str, dict[str, str]], tmp_path: Path) -> None:
    url, ids = db
    runner = CliRunner()
    out = runner.invoke(envs, ["list", "--database-url", url, "--status", "invalid"])
    assert out.exit_code == 0, out.output
    assert "BetaEnv" in out.output and "AlphaEnv" not in out.output
    out = runner.invoke(envs, ["show", "--database-url", url, ids["a"]])
    assert out.exit_code == 0 and "hint for Alpha" in out.output and "seed 4" in out.output
    out = runner.invoke(envs, ["show", "--database-url", url, "--code-only", ids["a"]])
    assert out.output.startswith("import random") and "class AlphaEnv" in out.output
    target = tmp_path / "out.jsonl"
    out = runner.invoke(envs, ["export", "--database-url", url, "--skill", "Optimization", "-o", str(target)])
    assert out.exit_code == 0
    assert [json.loads(x)["id"] for x in target.read_text().splitlines()] == [ids["a"]]


def test_envs_errors_are_clear(db: tuple[str, dict[str, str]], tmp_path: Path) -> None:
    url, _ = db
    runner = CliRunner()
    out = runner.invoke(envs, ["show", "--database-url", url, "ghost"])
    assert out.exit_code == 1 and "no environment with id 'ghost'" in out.output
    out = runner.invoke(envs, ["list", "--database-url", f"sqlite:///{tmp_path / 'missing.db'}"])
    assert out.exit_code == 1 and "no memory database" in out.output
    out = runner.invoke(envs, ["list", "--database-url", url, "--max-win-rate", "3"])
    assert out.exit_code == 2 and "max-win-rate" in out.output


def test_hash_token() -> None:
    out = CliRunner().invoke(envs, ["hash-token", "--token", "abc"])
    assert out.output.strip() == hash_key("abc")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_serve_refuses_to_start_without_a_token(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPADE_MEMORY_")}
    proc = subprocess.run(
        [sys.executable, "-m", "spade.cli", "serve", "memory"],
        check=False,
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "no API key configured" in proc.stderr
    assert "SPADE_MEMORY_API_KEYS" in proc.stderr and "Traceback" not in proc.stderr


async def test_serve_runs_grpc_and_rest(tmp_path: Path) -> None:
    rest_port, grpc_port = _free_port(), _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPADE_MEMORY_")}
    env.update(
        SPADE_MEMORY_DATABASE_URL=f"sqlite:///{tmp_path / 'served.db'}",
        SPADE_MEMORY_API_KEYS=json.dumps([{"tenant": "ops", "key_sha256": hash_key("tok")}]),
        SPADE_MEMORY_HTTP__PORT=str(rest_port),
        SPADE_MEMORY_GRPC__HOST="127.0.0.1",
        SPADE_MEMORY_GRPC__PORT=str(grpc_port),
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "spade.cli", "serve", "memory"],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{rest_port}") as http:
            deadline = time.monotonic() + 60
            while True:
                assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
                try:
                    if (await http.get("/healthz")).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "the memory service did not come up"
                time.sleep(0.2)
            anonymous = MemoryClient(f"127.0.0.1:{grpc_port}")
            with pytest.raises(Unauthenticated, match="missing API key"):
                await anonymous.put_environment(new_env("Served"))  # writes need a key, like reads
            await anonymous.close()
            client = MemoryClient(f"127.0.0.1:{grpc_port}", api_key="tok")
            put = await client.put_environment(new_env("Served"))
            await client.close()
            r = await http.get(f"/v1/environments/{put.env_id}", headers={"Authorization": "Bearer tok"})
            assert r.status_code == 200 and r.json()["hint"] == "hint for Served"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
