"""``spade cluster down`` stops by role, the last started first, and prints the order it really used.

The members are real processes (a ``spade``-named sleeper each, in its own session, as ``up`` starts
them) recorded in the runner's ``state.json``; no service runs.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.cluster.envfile import DEFAULT_ENV_FILES
from services.cluster.runner import Cluster

pytestmark = [pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]

SLEEPER = "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: sys.exit(0)); time.sleep(120)"


def test_down_stops_the_last_started_first_and_says_so(tmp_path: Path) -> None:
    lines: list[str] = []
    runner = Cluster(
        [ROOT / f for f in DEFAULT_ENV_FILES],
        environ={"SPADE_LOCAL_DATA_DIR": str(tmp_path), "SPADE_LEARNER_MODEL_PATH": str(tmp_path)},
        out=lines.append,
    )
    state = {}
    procs = []
    # Started in this order (as `up` does): learner, rollout-1, rollout-2.
    for i, (name, role) in enumerate([("learner", "learner"), ("rollout-1", "rollout"), ("rollout-2", "rollout")]):
        proc = subprocess.Popen([sys.executable, "-c", SLEEPER, "spade", name], start_new_session=True)
        procs.append(proc)
        state[name] = {"pid": proc.pid, "role": role, "argv": ["serve", role], "started": 1000.0 + i}
    runner.run_dir.mkdir(parents=True, exist_ok=True)
    runner.state_file.write_text(json.dumps(state))
    deadline = time.monotonic() + 30
    while not all(runner.pid(name) for name in state):  # each has exec'd (its command line names spade)
        assert time.monotonic() < deadline
        time.sleep(0.05)
    try:
        runner.down()
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    pid = {name: s["pid"] for name, s in state.items()}
    assert (
        lines[0]
        == f"cluster: stopping rollout-2 (pid {pid['rollout-2']}), rollout-1 (pid {pid['rollout-1']}) together: SIGTERM"
    )
    assert sorted(line.split(" stopped (")[0] for line in lines[1:3]) == ["cluster: rollout-1", "cluster: rollout-2"]
    assert lines[3] == f"cluster: stopping learner (pid {pid['learner']}): SIGTERM"
    assert lines[4].startswith("cluster: learner stopped (") and len(lines) == 5, lines
    assert json.loads(runner.state_file.read_text()) == {}
