"""``spade serve rollout`` and the run spec, as a process: refusal by field, waiting, storing a spec file.

The memory is the rollout's in-process ``sql`` variant over a SQLite file the test prepares, so the
run spec really is read from (and stored in) the memory's database; no model or sandbox is needed
because every case ends before the worker would play.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.memory.service import MemoryService
from services.memory.store.sql import SqlStore, make_engine, migrate
from spade.runspec import RunSpec

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # three `spade serve rollout` processes

ROOT = Path(__file__).resolve().parents[3]


def _config(tmp_path: Path, **fields: object) -> Path:
    config = {
        "dev_mode": True,
        "queue": {"kind": "inprocess"},
        "sandbox": {"kind": "pool"},
        "memory": {"kind": "sql", "url": f"sqlite:///{tmp_path / 'memory.db'}"},
        "state_url": f"sqlite:///{tmp_path / 'rollout.db'}",
        "inference_urls": ["http://127.0.0.1:9"],  # never reached: each case ends before
        **fields,
    }
    path = tmp_path / "rollout.json"
    path.write_text(json.dumps(config))
    return path


def _memory(tmp_path: Path) -> MemoryService:
    engine = make_engine(f"sqlite:///{tmp_path / 'memory.db'}")
    migrate(engine)
    return MemoryService(SqlStore(engine))


def _serve(config: Path, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "spade.cli", "serve", "rollout", "--config", str(config)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
    )


async def test_a_setting_contradicting_the_stored_spec_is_refused_naming_the_field(tmp_path: Path) -> None:
    memory = _memory(tmp_path)
    await memory.set_run_spec(RunSpec(group_size=16))
    proc = _serve(_config(tmp_path), env={"SPADE_ROLLOUT_GROUP_SIZE": "4"})
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 2, out
    assert "group_size: this service is configured with 4 but the run spec has 16" in out
    assert "SPADE_ROLLOUT_GROUP_SIZE" in out and "Traceback" not in out


async def test_without_a_stored_spec_it_waits_saying_so_and_sigterm_ends_the_wait(tmp_path: Path) -> None:
    _memory(tmp_path)
    proc = _serve(_config(tmp_path))
    assert proc.stdout is not None
    deadline = time.monotonic() + 300
    seen = []
    for line in proc.stdout:  # the wait is logged at once
        seen.append(line)
        if "waiting for a run spec" in line:
            break
        assert time.monotonic() < deadline and proc.poll() is None, "".join(seen)
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, "".join(seen) + rest
    assert "stopped while waiting for a run spec" in rest and "Traceback" not in rest


async def test_a_given_spec_file_is_stored_when_the_memory_has_none(tmp_path: Path) -> None:
    memory = _memory(tmp_path)
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text("group_size: 8\nagent_max_turns: 5\n")
    # A contradicting setting beside the file: the file is stored, then the setting is refused.
    proc = _serve(_config(tmp_path, run_spec_file=str(spec_file), agent_max_turns=6))
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 2 and "agent_max_turns" in out, out
    stored = RunSpec.from_json((await memory.get_run_spec()).spec_json)
    assert (stored.group_size, stored.agent_max_turns) == (8, 5)
