"""What the machine was doing, for the message of an end-to-end test whose command ran out of time.

A CI run once had three end-to-end commands (``podman-compose down``, ``spade cluster status``,
``spade cluster up``) each run past 600 s at the same time, and the failure said nothing about why.
A command that times out now fails with this snapshot: load, memory, the kernel's pressure stall
figures (``/proc/pressure``: how long tasks waited on the CPU, memory or I/O), free disk and the
processes stuck in uninterruptible sleep (state ``D``: waiting on the disk or the kernel).
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError as exc:
        return f"({exc.strerror})"


def machine_state() -> str:
    """A few lines on the machine now (each source that cannot be read says so instead)."""
    lines = [f"load: {_read('/proc/loadavg')}"]
    meminfo = dict(line.split(":", 1) for line in _read("/proc/meminfo").splitlines() if ":" in line)
    kept = [f"{k} {meminfo[k].strip()}" for k in ("MemAvailable", "Dirty", "Writeback") if k in meminfo]
    lines.append("memory: " + ", ".join(kept))
    for kind in ("cpu", "memory", "io"):
        lines.append(f"pressure {kind}: " + " | ".join(_read(f"/proc/pressure/{kind}").splitlines()))
    free = shutil.disk_usage(tempfile.gettempdir()).free
    lines.append(f"disk: {free / 2**30:.1f} GiB free under {tempfile.gettempdir()}")
    try:
        ps = subprocess.run(
            ["ps", "-eo", "stat,pid,etimes,wchan:32,args"], capture_output=True, text=True, timeout=10, check=False
        ).stdout.splitlines()
        stuck = [line[:200] for line in ps[1:] if line.lstrip().startswith("D")]
        lines.append("uninterruptible (D): " + ("none" if not stuck else "\n  " + "\n  ".join(stuck)))
    except (OSError, subprocess.TimeoutExpired) as exc:
        lines.append(f"ps: {exc}")
    return "\n".join(lines)


def timed_out(exc: subprocess.TimeoutExpired) -> str:
    """The message for a command that ran out of time: the command, what it printed, the machine."""

    def tail(data: bytes | str | None) -> str:
        text = data.decode(errors="replace") if isinstance(data, bytes) else (data or "")
        return text[-2000:]

    command = " ".join(map(str, exc.cmd)) if isinstance(exc.cmd, list | tuple) else str(exc.cmd)
    return (
        f"{command} ran past {exc.timeout:g} s\nstdout: {tail(exc.output)}\nstderr: {tail(exc.stderr)}\n"
        f"the machine then:\n{machine_state()}"
    )
