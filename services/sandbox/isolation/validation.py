"""Validation reports for checker runs the sandbox had to stop.

The checker streams which check it is running; when its process is killed (wall clock, CPU, memory,
a crash) the pool still returns a full ``ValidationReport``: the checks that finished, the one that
was running marked failed with why it was stopped, and the rest marked not run.
"""

from __future__ import annotations

from typing import Any

from spade.envs.types import CHECK_NAMES, CheckResult, ValidationReport


def stopped_report(
    setting: str,
    code: str,
    running: str | None,
    finished: list[dict[str, Any]],
    reason: str,
    duration_ms: float,
) -> ValidationReport:
    """A failed report for a checker stopped while running ``running``.

    Args:
        setting: the env's setting.
        code: the code that was being checked (kept as ``repaired_code``).
        running: the check in progress when it stopped (``None``: before the first check).
        finished: results the checker streamed before it stopped (``CheckResult.to_dict`` form).
        reason: why it was stopped, e.g. "the validation ran past its wall-clock limit of 60 s".
        duration_ms: wall time until it was stopped.
    """
    done = {str(r["name"]): CheckResult.from_dict(r) for r in finished if "name" in r}
    stopped_at = running or CHECK_NAMES[0]
    checks: list[CheckResult] = []
    reached = False
    for name in CHECK_NAMES:
        if name in done:
            checks.append(done[name])
        elif name == stopped_at:
            reached = True
            checks.append(CheckResult(name, False, f"stopped while running: {reason}; fix the env so this check ends"))
        elif not reached:
            checks.append(
                CheckResult(
                    name, False, "finished before the checker was stopped; its result was lost with the process"
                )
            )
        else:
            checks.append(CheckResult(name, False, f"not run: the checker was stopped during {stopped_at!r}"))
    return ValidationReport(
        valid=False, setting=setting, env_class="", checks=checks, repaired_code=code, duration_ms=duration_ms
    )
