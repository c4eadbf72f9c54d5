"""The sandbox's wire messages as domain values and back: one translation, used by server and client.

>>> from spade.envs import Outcome
>>> from spade.v1 import types_pb2
>>> timeout = sandbox_pb2.SessionState(observation="o", outcome=types_pb2.OUTCOME_TIMEOUT)
>>> state = state_message("s1", state_outcome(timeout))
>>> (state.session_id, state.observation, state_outcome(state).outcome)
('s1', 'o', <Outcome.TIMEOUT: 'timeout'>)
>>> state_outcome(sandbox_pb2.SessionState(outcome=99)).outcome is Outcome.SANDBOX_FAULT
True
"""

from __future__ import annotations

import json
from typing import Any

from spade.envs import CheckResult, Outcome, Setting, StepOutcome, ValidationReport
from spade.sandbox.execution import ExecStatus, ExecutionResult
from spade.v1 import sandbox_pb2
from spade.wire_enums import from_wire, to_wire


def _value(field: Any) -> str:
    """An enum's string value, or the string itself."""
    return str(getattr(field, "value", field))


def setting_message(setting: str) -> Any:
    """A request's ``setting`` (``"game"``/``"tool"`` or a ``Setting``) as its wire number.

    Raises:
        ValueError: Neither game nor tool (the message names both).
    """
    return to_wire(Setting.parse(setting))


def requested_setting(number: int) -> object:
    """A request's setting as the service checks it: a game when none is set (the contract's
    default), else the ``Setting`` it names; a number this side does not know is passed on as it is,
    for the service's check to refuse by name."""
    if not number:
        return Setting.GAME
    try:
        return from_wire(Setting, number)
    except ValueError:
        return number


def state_message(session_id: str, outcome: StepOutcome) -> sandbox_pb2.SessionState:
    """A session's ``StepOutcome`` as the ``SessionState`` sent to the client."""
    return sandbox_pb2.SessionState(
        session_id=session_id,
        observation=outcome.observation,
        reward=float(outcome.reward),
        terminated=bool(outcome.terminated),
        truncated=bool(outcome.truncated),
        info_json=json.dumps(outcome.info, default=str),
        turn=int(outcome.turn),
        max_turns=int(outcome.max_turns),
        outcome=to_wire(Outcome(outcome.outcome)),
    )


def state_outcome(state: sandbox_pb2.SessionState) -> StepOutcome:
    """A ``SessionState`` from the wire as a ``StepOutcome`` (an unknown or missing verdict is a sandbox fault)."""
    try:
        info = json.loads(state.info_json) if state.info_json else {}
    except json.JSONDecodeError:
        info = {}
    # A verdict this client does not know (a newer sandbox's), or none at all, is the sandbox's fault.
    fault = Outcome.SANDBOX_FAULT
    outcome = from_wire(Outcome, state.outcome, unknown=fault) if state.outcome else fault
    return StepOutcome(
        observation=state.observation,
        reward=state.reward,
        terminated=state.terminated,
        truncated=state.truncated,
        info=info if isinstance(info, dict) else {},
        turn=state.turn,
        max_turns=state.max_turns,
        outcome=outcome,
    )


def report_message(report: ValidationReport) -> sandbox_pb2.ValidationReport:
    """A ``ValidationReport`` as its wire message."""
    return sandbox_pb2.ValidationReport(
        valid=report.valid,
        setting=to_wire(Setting.parse(report.setting)),
        env_class=report.env_class or "",
        checks=[sandbox_pb2.CheckResult(name=c.name, passed=c.passed, detail=c.detail) for c in report.checks],
        repaired_code=report.repaired_code or "",
        duration_ms=float(report.duration_ms or 0.0),
    )


def report_from_message(message: sandbox_pb2.ValidationReport) -> ValidationReport:
    """The wire's ``ValidationReport`` as the contract library's ``ValidationReport``."""
    return ValidationReport(
        valid=message.valid,
        setting=from_wire(Setting, message.setting),
        env_class=message.env_class,
        checks=[CheckResult(name=c.name, passed=c.passed, detail=c.detail) for c in message.checks],
        repaired_code=message.repaired_code,
        duration_ms=message.duration_ms,
    )


def execution_message(result: ExecutionResult) -> sandbox_pb2.ExecuteResult:
    """An ``ExecutionResult`` as its wire message (an unknown exit code is sent as -1)."""
    exit_code: int | None = result.exit_code
    return sandbox_pb2.ExecuteResult(
        status=_value(result.status),
        exit_code=int(exit_code if exit_code is not None else -1),
        stdout=result.stdout,
        stderr=result.stderr,
        duration_ms=float(result.duration_ms),
    )


def execution_from_message(message: sandbox_pb2.ExecuteResult) -> ExecutionResult:
    """The wire's ``ExecuteResult`` as an ``ExecutionResult``.

    Raises:
        ValueError: The status is none of ``ExecStatus`` (a sandbox newer than this client).
    """
    try:
        status = ExecStatus(message.status)
    except ValueError:
        known = ", ".join(s.value for s in ExecStatus)
        raise ValueError(
            f"the sandbox answered execution status {message.status!r}, not one of {known}: "
            "upgrade this client to the sandbox's version"
        ) from None
    return ExecutionResult(
        status=status,
        exit_code=message.exit_code,
        stdout=message.stdout,
        stderr=message.stderr,
        duration_ms=message.duration_ms,
    )
