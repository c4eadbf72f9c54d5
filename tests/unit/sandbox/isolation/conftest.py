"""Every test here leaves no sandbox process behind."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

# Staging dirs of pools started by this test process (their name carries its pid).
_MINE = re.compile(rf"(/[\w./-]*/spade-sandbox-{os.getpid()}-\w+)")


def orphans() -> dict[int, str]:
    """Processes of this test process's pools whose staging directory is gone (the pool stopped)."""
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")
        except OSError:
            continue
        for staging in _MINE.findall(cmdline):
            if not Path(staging).exists():
                found[int(entry.name)] = cmdline[:200]
    return found


@pytest.fixture(autouse=True)
def no_stray_processes() -> Iterator[None]:
    yield
    # A killed jail's last process may take a moment to be reaped; a leak never goes away.
    deadline = time.monotonic() + 3.0
    while (left := orphans()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert left == {}, "sandbox processes outlived their pool"
