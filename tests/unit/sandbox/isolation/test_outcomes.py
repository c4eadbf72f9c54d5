"""How what the sandbox observed maps to an execution status (one place, one table)."""

from __future__ import annotations

import signal

import pytest

from services.sandbox.isolation.outcomes import ExecStatus, Observed, classify_execution

CPU = 10.0


@pytest.mark.parametrize(
    ("seen", "expected"),
    [
        (Observed({"code": 0}, None, False, False, CPU), (ExecStatus.OK, 0)),
        (Observed({"code": 3}, None, False, False, CPU), (ExecStatus.ERROR, 3)),
        (Observed({"code": 1, "memory": True}, None, False, False, CPU), (ExecStatus.MEMORY_LIMIT, 1)),
        (Observed({"code": 1, "file_limit": True}, None, False, False, CPU), (ExecStatus.OUTPUT_LIMIT, 1)),
        (Observed({"signal": signal.SIGXCPU, "cpu_s": 10.0}, None, False, False, CPU), (ExecStatus.CPU_LIMIT, -24)),
        # The hard CPU limit (soft + 1 s) kills with SIGKILL once SIGXCPU was ignored.
        (Observed({"signal": signal.SIGKILL, "cpu_s": 11.0}, None, False, False, CPU), (ExecStatus.CPU_LIMIT, -9)),
        # A SIGKILL with CPU time to spare came from elsewhere (e.g. kill(getpid())).
        (Observed({"signal": signal.SIGKILL, "cpu_s": 0.1}, None, False, False, CPU), (ExecStatus.KILLED, -9)),
        (Observed({"signal": signal.SIGSEGV, "cpu_s": 0.1}, None, False, False, CPU), (ExecStatus.KILLED, -11)),
        (Observed({"signal": signal.SIGXFSZ}, None, False, False, CPU), (ExecStatus.OUTPUT_LIMIT, -25)),
        # The service's own verdicts win over whatever the program reported.
        (Observed({"code": 0}, None, True, False, CPU), (ExecStatus.TIMEOUT, 0)),
        (Observed(None, {"signal": 9}, True, False, CPU), (ExecStatus.TIMEOUT, -9)),
        (Observed({"code": 0}, None, False, True, CPU), (ExecStatus.OUTPUT_LIMIT, 0)),
        (Observed(None, {"signal": 9}, False, True, CPU), (ExecStatus.OUTPUT_LIMIT, -9)),
        # pid 1 died without a report: it was killed.
        (Observed(None, {"signal": 9}, False, False, CPU), (ExecStatus.KILLED, -9)),
        (Observed(None, {"code": 0}, False, False, CPU), (ExecStatus.KILLED, -9)),
    ],
)
def test_classification(seen: Observed, expected: tuple[ExecStatus, int]) -> None:
    assert classify_execution(seen) == expected


def test_statuses_are_the_wire_names() -> None:
    assert [s.value for s in ExecStatus] == [
        "ok",
        "error",
        "timeout",
        "cpu_limit",
        "memory_limit",
        "output_limit",
        "killed",
    ]
