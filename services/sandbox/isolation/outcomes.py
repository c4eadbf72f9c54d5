"""Domain types of the isolation layer: execution limits, statuses and results, and their mapping.

``classify_execution`` is the single place where what the sandbox observed (the program's end as
witnessed by pid 1, the service's timers and output caps) becomes an ``ExecStatus``.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class SandboxFault(Exception):
    """The sandbox itself failed (zygote died, jail could not be built); the code is not to blame."""


class ExecStatus(StrEnum):
    """How an execution ended.

    - ``ok``: exited 0. ``error``: exited non-zero (an uncaught exception is exit 1).
    - ``timeout``: ran past its wall-clock limit or its CPU-time limit.
    - ``memory_limit``: ran out of its address-space limit (``MemoryError``).
    - ``output_limit``: wrote more stdout/stderr than the caps, or a file over the file-size limit.
    - ``killed``: ended by a signal for another reason (e.g. a segfault in native code).
    """

    OK = "ok"
    ERROR = "error"
    TIMEOUT = "timeout"
    MEMORY_LIMIT = "memory_limit"
    OUTPUT_LIMIT = "output_limit"
    KILLED = "killed"


@dataclass(frozen=True)
class ExecLimits:
    """Limits of one execution; ``None`` fields take the service defaults (``IsolationSettings``).

    Attributes:
        timeout_s: wall-clock limit, enforced by the service.
        memory_mb: address-space rlimit of each process.
        cpu_s: CPU-time rlimit of each process (defaults to the wall-clock limit, rounded up).
    """

    timeout_s: float | None = None
    memory_mb: int | None = None
    cpu_s: float | None = None


@dataclass(frozen=True)
class ExecutionResult:
    """The result of ``SandboxPool.execute``.

    Attributes:
        status: how the program ended.
        exit_code: its exit code; ``-N`` when signal ``N`` ended it (as ``subprocess`` reports).
        stdout: what it wrote to stdout, cut at the cap.
        stderr: what it wrote to stderr, cut at the cap.
        duration_ms: wall time from the request reaching the sandbox to the program's end.
    """

    status: ExecStatus
    exit_code: int
    stdout: bytes
    stderr: bytes
    duration_ms: float

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form (stdout/stderr decoded as UTF-8 with replacement)."""
        return {
            "status": self.status.value,
            "exit_code": self.exit_code,
            "stdout": self.stdout.decode("utf-8", "replace"),
            "stderr": self.stderr.decode("utf-8", "replace"),
            "duration_ms": self.duration_ms,
        }


@dataclass(frozen=True)
class Observed:
    """What the service saw of one execution, the input of ``classify_execution``.

    Attributes:
        report: pid 1's ``exit`` message (``code`` or ``signal``, ``memory``, ``cpu_s``), or ``None``
            when pid 1 died without one.
        exited: the zygote's ``exited`` message for the request's holder process, if received.
        timed_out: the service's wall-clock timer fired.
        output_exceeded: stdout or stderr passed its cap.
        cpu_limit_s: the CPU-time rlimit the program ran under.
    """

    report: dict[str, Any] | None
    exited: dict[str, Any] | None
    timed_out: bool
    output_exceeded: bool
    cpu_limit_s: float


def classify_execution(seen: Observed) -> tuple[ExecStatus, int]:
    """Map what was observed to ``(status, exit_code)``; the service's own verdicts come first.

    >>> classify_execution(Observed({"code": 0}, None, False, False, 10))
    (<ExecStatus.OK: 'ok'>, 0)
    >>> classify_execution(Observed({"signal": 24, "cpu_s": 10.0}, None, False, False, 10))[0].value
    'timeout'
    """
    report = seen.report or {}
    sig = report.get("signal")
    if sig is None and seen.report is None and seen.exited is not None:
        sig = seen.exited.get("signal")
    exit_code = (
        -int(sig) if sig is not None else int(report.get("code", (seen.exited and seen.exited.get("code")) or 0))
    )
    if seen.timed_out:
        return ExecStatus.TIMEOUT, exit_code if sig is None else -signal.SIGKILL
    if seen.output_exceeded:
        return ExecStatus.OUTPUT_LIMIT, exit_code
    if sig is not None:
        cpu = float(report.get("cpu_s", 0.0))
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu >= seen.cpu_limit_s - 0.5):
            return ExecStatus.TIMEOUT, exit_code
        if sig == signal.SIGXFSZ:
            return ExecStatus.OUTPUT_LIMIT, exit_code
        return ExecStatus.KILLED, exit_code
    if report.get("file_limit"):
        return ExecStatus.OUTPUT_LIMIT, exit_code
    if report.get("memory"):
        return ExecStatus.MEMORY_LIMIT, exit_code
    if seen.report is None:
        # pid 1 ended without a word and without a signal: it was stopped from outside.
        return ExecStatus.KILLED, exit_code or -signal.SIGKILL
    return (ExecStatus.OK if exit_code == 0 else ExecStatus.ERROR), exit_code
