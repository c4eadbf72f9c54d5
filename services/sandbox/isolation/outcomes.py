"""Domain types of the isolation layer: execution limits and the mapping of what was observed to a status.

The statuses, results and ``SandboxFault`` themselves live in ``spade.sandbox`` (the client answers
them too); they are re-exported here for the isolation layer's modules.

``classify_execution`` is the single place where what the sandbox observed (the program's end as
witnessed by pid 1, the service's timers and output caps) becomes an ``ExecStatus``;
``classify_session_end`` is its twin for an env session's process (an ``Outcome``).
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Any

from services.sandbox.runtime.protocol import MEMORY_EXIT
from spade.envs.types import Outcome
from spade.sandbox.errors import SandboxFault
from spade.sandbox.execution import ExecStatus, ExecutionResult

__all__ = [
    "ENV_CLAIMABLE",
    "ExecLimits",
    "ExecStatus",
    "ExecutionResult",
    "Observed",
    "SandboxFault",
    "classify_execution",
    "classify_session_end",
]


@dataclass(frozen=True)
class ExecLimits:
    """Limits of one execution; ``None`` fields take the service defaults (``IsolationSettings``).

    Attributes:
        timeout_s: wall-clock limit, enforced by the service.
        memory_mb: address-space rlimit of each process.
        cpu_s: CPU-time rlimit of each process (default: one second over the wall-clock limit,
            rounded up, so that a program given only a wall clock meets that first).
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
        exited: the zygote's ``exited`` message for the request's jail (its pid 1), if received.
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
    'cpu_limit'
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
            return ExecStatus.CPU_LIMIT, exit_code
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


ENV_CLAIMABLE: frozenset[Outcome] = frozenset(
    {Outcome.OK, Outcome.ENV_ERROR, Outcome.TIMEOUT, Outcome.LIMIT, Outcome.MEMORY_LIMIT}
)
"""Outcomes an env's process may report about its own calls. The rest are the sandbox's to observe
(``cpu_limit``, ``killed``: pid 1's witness report; ``output_limit``: the reply's size;
``sandbox_fault``: never from an env), so an env cannot pass its failures off as the sandbox's."""


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return str(sig)


def classify_session_end(
    report: dict[str, Any] | None, exited: dict[str, Any] | None, cpu_limit_s: float
) -> tuple[Outcome, str]:
    """How a session's env process ended, as ``(outcome, message)``.

    Args:
        report: pid 1's witness report (``{"op": "exit", "code" | "signal", "cpu_s", "memory"}``,
            or ``{"op": "fault", "error"}`` when pid 1 itself failed); ``None`` if it sent none.
        exited: the zygote's ``exited`` message for the jail, if known (used when pid 1 said nothing).
        cpu_limit_s: the CPU-time rlimit the session ran under.

    >>> classify_session_end({"op": "exit", "signal": 24, "cpu_s": 1.0}, None, 1.0)[0].value
    'cpu_limit'
    >>> classify_session_end({"op": "exit", "signal": 9, "cpu_s": 0.1}, None, 60.0)[0].value
    'killed'
    >>> classify_session_end({"op": "exit", "code": 86, "memory": True}, None, 60.0)[0].value
    'memory_limit'
    """
    if report is not None and report.get("op") == "fault":
        return Outcome.SANDBOX_FAULT, f"the session's jail failed: {str(report.get('error'))[:300]}"
    if report is None or report.get("op") != "exit":
        if exited is None:
            return Outcome.SANDBOX_FAULT, "the session's jail was lost (its zygote died)"
        sig = exited.get("signal")
        if sig is not None:
            return Outcome.KILLED, f"the session's processes were killed by signal {sig} ({_signal_name(int(sig))})"
        return Outcome.SANDBOX_FAULT, f"the session's jail ended (code {exited.get('code')}) without a report"
    sig = report.get("signal")
    cpu = float(report.get("cpu_s") or 0.0)
    if sig is not None:
        sig = int(sig)
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu >= cpu_limit_s - 0.5):
            return Outcome.CPU_LIMIT, f"the env used up its CPU-time limit of {cpu_limit_s:g} s"
        return Outcome.KILLED, f"the env's process was killed by signal {sig} ({_signal_name(sig)})"
    code = report.get("code")
    if report.get("memory") or code == MEMORY_EXIT:
        return Outcome.MEMORY_LIMIT, "the env ran out of its memory limit"
    return Outcome.ENV_ERROR, f"the env's process exited (code {code}) mid-session"
