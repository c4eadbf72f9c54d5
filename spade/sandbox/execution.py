"""What one plain code execution in the sandbox ended as (``Execute``), on either side of the wire."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class ExecStatus(StrEnum):
    """How an execution ended.

    - ``ok``: exited 0. ``error``: exited non-zero (an uncaught exception is exit 1).
    - ``timeout``: ran past its wall-clock limit.
    - ``cpu_limit``: used up its CPU-time limit (SIGXCPU, or SIGKILL at the hard limit).
    - ``memory_limit``: ran out of its address-space limit (``MemoryError``).
    - ``output_limit``: wrote more stdout/stderr than the caps, or a file over the file-size limit.
    - ``killed``: ended by a signal for another reason (e.g. a segfault in native code).
    """

    OK = "ok"
    ERROR = "error"
    TIMEOUT = "timeout"
    CPU_LIMIT = "cpu_limit"
    MEMORY_LIMIT = "memory_limit"
    OUTPUT_LIMIT = "output_limit"
    KILLED = "killed"


@dataclass(frozen=True)
class ExecutionResult:
    """The result of one execution (the sandbox pool's ``execute`` and the client's ``execute``).

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
