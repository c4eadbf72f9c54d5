"""One real sandbox pool for the whole escape suite, and the check that no process outlives it.

The service's environment holds a planted secret (``SPADE_ESCAPE_SECRET``) before the pool starts,
and secret files are planted in a world-readable temp dir and in ``/root``: attacks must not see them.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from services.sandbox.isolation import IsolationSettings, SandboxPool
from tests.conftest import needs

SANDBOX_UID = 65534
SECRET = "spade-escape-" + secrets.token_hex(8)


def sandbox_pids(uid: int = SANDBOX_UID) -> dict[int, str]:
    """Host pids owned by ``uid`` (real uid), with their command lines."""
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("Uid:") and int(line.split()[1]) == uid:
                found[int(entry.name)] = cmdline
    return found


def descendants(root: int) -> set[int]:
    """Pids whose parent chain reaches ``root`` (read from /proc)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found: set[int] = set()
    for pid in parents:
        chain, cursor = [], pid
        while cursor in parents and cursor not in (0, 1) and cursor != root:
            chain.append(cursor)
            cursor = parents[cursor]
        if cursor == root:
            found.update(chain)
    return found


@pytest.fixture(scope="session")
def planted() -> Iterator[dict[str, Path]]:
    """Secret files readable by anyone on the host: only the sandbox's view must hide them."""
    # World-readable on purpose: only the sandbox's filesystem view may hide it, not permissions.
    tmp_dir = Path(tempfile.mkdtemp(prefix="spade-planted-"))
    tmp_dir.chmod(0o755)
    tmp_secret = tmp_dir / "secret.txt"
    tmp_secret.write_text(SECRET)
    tmp_secret.chmod(0o644)
    root_secret = Path("/root") / f"spade-escape-{secrets.token_hex(4)}.txt"
    root_secret.write_text(SECRET)
    root_secret.chmod(0o644)
    yield {"tmp": tmp_secret, "root": root_secret}
    root_secret.unlink(missing_ok=True)
    shutil.rmtree(tmp_dir, ignore_errors=True)


@pytest_asyncio.fixture(scope="session", loop_scope="session")
@needs("sandbox")
async def pool(planted: dict[str, Path]) -> AsyncIterator[SandboxPool]:
    os.environ["SPADE_ESCAPE_SECRET"] = SECRET
    before = set(sandbox_pids())
    pool = SandboxPool(
        IsolationSettings(
            wall_seconds=5.0,
            processes=32,
            memory_mb=256,
            step_seconds=1.5,
            session_start_seconds=5.0,
            validate_wall_seconds=4.0,
        )
    )
    await pool.start()
    instance = pool.instance
    assert instance
    try:
        yield pool
    finally:
        await pool.stop()
        os.environ.pop("SPADE_ESCAPE_SECRET", None)
    # Nothing may outlive the pool: not a zygote, not a jail, not a fork-bomb child. (A killed
    # jail's last process may take a moment to be reaped; a leak never goes away.)
    deadline = time.monotonic() + 3.0
    while True:
        sandboxed = sandbox_pids()
        outlived = {pid: cmd for pid, cmd in sandboxed.items() if pid not in before and pid in descendants(os.getpid())}
        outlived |= {pid: cmd for pid, cmd in sandboxed.items() if instance in cmd}
        if not outlived or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not outlived, f"sandbox processes outlived the pool: {outlived}"
