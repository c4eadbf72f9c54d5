"""``spade eval`` end to end with the real model: killed mid-run, resumed, extended, compared."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.model, pytest.mark.timeout(1800)]

ENV = {
    **os.environ,
    "SPADE_EVAL_MAX_NEW_TOKENS": "12",
    "SPADE_EVAL_CONCURRENCY": "1",
    "SPADE_EVAL_TORCH_THREADS": "1",
    "SPADE_EVAL_BOOTSTRAP_RESAMPLES": "200",
}


def _eval(*args: str) -> list[str]:
    return [sys.executable, "-m", "spade.cli", "eval", "--suite", "reasoning-gym", *args]


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def test_a_killed_eval_resumes_without_redoing_items(tmp_path: Path) -> None:
    out = tmp_path / "run"
    items = out / "items.jsonl"
    command = _eval("--limit", "4", "--out", str(out))
    proc = subprocess.Popen(command, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 900
        while len(_lines(items)) < 1 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()[1].decode()[-2000:]
        os.killpg(proc.pid, signal.SIGKILL)  # no clean-up of any kind
    finally:
        proc.wait()
    before = _lines(items)
    assert 1 <= len(before) < 4

    done = subprocess.run([*command, "--json"], env=ENV, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    after = _lines(items)
    assert after[: len(before)] == before  # the finished items are kept as they were ...
    ids = [json.loads(line)["id"] for line in after]
    assert len(ids) == 4 and len(set(ids)) == 4  # ... and none was done twice
    assert f"resuming {out}: {len(before)} items already done" in done.stderr
    summary = json.loads(done.stdout)
    assert summary["categories"]["overall"]["n"] == 4 and summary["run"]["weight_version"] == "0"
    assert set(summary["categories"]) == {"math", "algorithmic", "cognition", "logic", "overall"}
    assert json.loads((out / "summary.json").read_text())["categories"]["overall"]["n"] == 4

    more = subprocess.run(
        _eval("--limit", "5", "--out", str(out)), env=ENV, capture_output=True, text=True, check=False
    )
    assert more.returncode == 0, more.stderr[-2000:]
    assert _lines(items)[:4] == after and len(_lines(items)) == 5

    other = {**ENV, "SPADE_EVAL_MAX_NEW_TOKENS": "13"}  # another run's settings: refused, not mixed in
    refused = subprocess.run(
        _eval("--limit", "5", "--out", str(out)), env=other, capture_output=True, text=True, check=False
    )
    assert refused.returncode == 1 and "another run's results" in refused.stderr
    assert refused.stderr.count("\n") == 1 and "Traceback" not in refused.stderr

    compared = subprocess.run(
        [sys.executable, "-m", "spade.cli", "eval", "compare", str(out), str(out), "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    result = json.loads(compared.stdout)
    assert result["paired"] == 5 and result["categories"]["overall"]["difference"]["mean"] == 0.0
