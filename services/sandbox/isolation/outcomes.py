"""Domain types of the isolation layer: execution limits and the mapping of what was observed to a status.

The statuses, results and ``SandboxFault`` themselves live in ``spade.sandbox`` (the client answers
them too); they are re-exported here for the isolation layer's modules.

``classify_execution`` is the single place where what the sandbox observed (the program's end as
witnessed by pid 1, the service's timers and output caps) becomes an ``ExecStatus``.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Any

from spade.sandbox.errors import SandboxFault
from spade.sandbox.execution import ExecStatus, ExecutionResult

__all__ = ["ExecLimits", "ExecStatus", "ExecutionResult", "Observed", "SandboxFault", "classify_execution"]


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
