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

from services.memory.cli import envs, runspec
from services.memory.store.sql import SqlStore, make_engine, migrate
from spade.auth import Unauthenticated, hash_key
from spade.envs.types import FinishReason
from spade.memory.client import MemoryClient
from spade.memory.records import EnvStatus, Play
from spade.runspec import RunSpec
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
    store.record_plays([Play(ids["a"], 4, False, 1.0, 2, 0, "tr-1", FinishReason.TERMINATED)])
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


def test_hash_token_prints_an_entry_with_its_role_that_configures_the_memory() -> None:
    from services.memory.settings import MemorySettings
    from spade.auth import Role

    out = CliRunner().invoke(envs, ["hash-token", "--generate", "--tenant", "web", "--role", "read"])
    assert out.exit_code == 0, out.output
    lines = dict(line.split(":", 1) for line in out.output.splitlines())
    entry = json.loads(lines["entry"])
    settings = MemorySettings(api_keys=[entry])
    assert getattr(settings.keyring().verify(lines["token"].strip()), "role", None) is Role.READ
    assert CliRunner().invoke(envs, ["hash-token", "--generate", "--role", "root"]).exit_code == 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
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


@pytest.mark.slow
async def test_serve_runs_grpc_and_rest(tmp_path: Path) -> None:
    rest_port, grpc_port = _free_port(), _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPADE_MEMORY_")}
    env.update(
        SPADE_MEMORY_DATABASE_URL=f"sqlite:///{tmp_path / 'served.db'}",
        SPADE_MEMORY_API_KEYS=json.dumps(
            [
                {"tenant": "ops", "key_sha256": hash_key("tok"), "role": "admin"},
                {"tenant": "rollout", "key_sha256": hash_key("svc")},  # no role: write
            ]
        ),
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


def _memory_env(tmp_path: Path, rest_port: int, grpc_port: int, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPADE_MEMORY_")}
    env.update(
        SPADE_MEMORY_DATABASE_URL=f"sqlite:///{tmp_path / 'served.db'}",
        SPADE_MEMORY_API_KEYS=json.dumps(
            [
                {"tenant": "ops", "key_sha256": hash_key("tok"), "role": "admin"},
                {"tenant": "rollout", "key_sha256": hash_key("svc")},  # no role: write
            ]
        ),
        SPADE_MEMORY_HTTP__PORT=str(rest_port),
        SPADE_MEMORY_GRPC__PORT=str(grpc_port),
        SPADE_MEMORY_VENDI="false",
        **extra,
    )
    return env


@pytest.mark.slow
def test_runspec_set_and_show_against_a_served_memory(tmp_path: Path) -> None:
    rest_port, grpc_port = _free_port(), _free_port()
    given = tmp_path / "spec.yaml"
    given.write_text("group_size: 8\nwindow_versions_game: 2\n")
    env = _memory_env(tmp_path, rest_port, grpc_port, SPADE_MEMORY_RUN_SPEC_FILE=str(given))
    proc = subprocess.Popen(
        [sys.executable, "-m", "spade.cli", "serve", "memory"],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            try:
                if httpx.get(f"http://127.0.0.1:{rest_port}/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the memory service did not come up"
            time.sleep(0.2)
        runner = CliRunner()
        target = ["--memory", f"127.0.0.1:{grpc_port}"]
        stored = RunSpec(group_size=8, window_versions_game=2)  # the service stored its spec file at start
        shown = runner.invoke(runspec, ["show", *target, "--memory-key", "tok"])
        assert shown.exit_code == 0, shown.output
        assert f"# run spec {stored.spec_id}" in shown.output
        assert RunSpec.from_json(shown.output.split("\n", 1)[1]) == stored

        anonymous = runner.invoke(runspec, ["show", *target])
        assert anonymous.exit_code == 1 and "missing API key" in anonymous.output

        other = tmp_path / "other.json"
        other.write_text(json.dumps({"group_size": 4, "window_versions_game": 2}))
        # A service's key reads the spec but cannot set it: 403, one clear line, no traceback.
        assert runner.invoke(runspec, ["show", *target, "--memory-key", "svc"]).exit_code == 0
        forbidden = runner.invoke(runspec, ["set", str(other), "--replace", *target, "--memory-key", "svc"])
        assert forbidden.exit_code == 1 and "'rollout' has the write role" in forbidden.output, forbidden.output
        assert "needs admin" in forbidden.output and "Traceback" not in forbidden.output
        refused = runner.invoke(runspec, ["set", str(other), *target, "--memory-key", "tok"])
        assert refused.exit_code == 1 and "group_size: stored 8, given 4" in refused.output
        assert "Traceback" not in refused.output
        replaced = runner.invoke(runspec, ["set", str(other), "--replace", *target, "--memory-key", "tok"])
        assert replaced.exit_code == 0 and RunSpec(group_size=4, window_versions_game=2).spec_id in replaced.output
        bad = tmp_path / "bad.yaml"
        bad.write_text("group_size: 1\nfavourite_colour: blue\n")
        invalid = runner.invoke(runspec, ["set", str(bad), *target, "--memory-key", "tok"])
        assert invalid.exit_code == 2 and "group_size" in invalid.output and "favourite_colour" in invalid.output
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.slow
def test_serve_refuses_a_spec_its_own_settings_contradict(tmp_path: Path) -> None:
    given = tmp_path / "spec.yaml"
    given.write_text("{}\n")  # the paper's defaults: k = 4 for game envs
    env = _memory_env(
        tmp_path,
        _free_port(),
        _free_port(),
        SPADE_MEMORY_RUN_SPEC_FILE=str(given),
        SPADE_MEMORY_WINDOW_VERSIONS_GAME="2",
    )
    proc = subprocess.run(
        [sys.executable, "-m", "spade.cli", "serve", "memory"],
        check=False,
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "window_versions_game: this service is configured with 2 but the run spec has 4" in proc.stderr
    assert "Traceback" not in proc.stderr
