"""Every test here leaves no sandbox process behind."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

_STAGING = re.compile(r"(/[\w./-]*/spade-sandbox-\w+)")


def orphans() -> dict[int, str]:
    """Processes that still name a staging directory which no longer exists (its pool has stopped)."""
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")
        except OSError:
            continue
        for staging in _STAGING.findall(cmdline):
            if not Path(staging).exists():
                found[int(entry.name)] = cmdline[:200]
    return found


@pytest.fixture(autouse=True)
def no_stray_processes() -> Iterator[None]:
    yield
    assert orphans() == {}, "sandbox processes outlived their pool"
