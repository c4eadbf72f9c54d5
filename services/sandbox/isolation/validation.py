"""Validation in the sandbox: the checker plays every episode through a real session.

Validation must be indistinguishable from play (DESIGN §4). So the sandbox has one way to run env
code turn by turn, a session (``SandboxPool.open_session``: a fresh jail whose env process runs
``spade.envs.remote.SessionHost``), and the checker (``spade.envs.check_env_source``) plays through
it: each episode it plays is its own session, opened and played exactly as a rollout's play is, on
seeds the checker draws in secret from the play seed distribution. The checker itself runs in a
worker thread of the service and never runs env code; it judges only what the sessions answer.

When a validation is stopped (its wall clock), the pool still returns a full ``ValidationReport``:
the checks that finished, the one that was running marked failed with why it was stopped, and the
rest marked not run.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from services.sandbox.isolation.outcomes import SandboxFault
from services.sandbox.isolation.session import SandboxSession, SessionEnded
from spade.envs import check_env_source
from spade.envs.remote import RemoteRuntime
from spade.envs.types import CHECK_NAMES, CheckConfig, CheckResult, Outcome, Setting, StepOutcome, ValidationReport

T = TypeVar("T")


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


# -- validation through sessions ---------------------------------------------------------------------


class ValidationStopped(Exception):
    """The validation was stopped (its wall clock ran out): no more sessions are opened or played."""


class ValidationRun:
    """What the checker's thread and the service share about one validation.

    Attributes:
        stopped: Set when the validation is stopped (its wall clock, or a sandbox fault).
        fault: The sandbox's own failure that stopped it (then no verdict is given), else ``None``.
    """

    def __init__(self) -> None:
        self.stopped = threading.Event()
        self.fault: str | None = None

    def failed(self, message: str) -> ValidationStopped:
        """Record a sandbox fault and stop the validation: a broken sandbox gives no verdict."""
        self.fault = self.fault or message
        self.stopped.set()
        return ValidationStopped(f"the sandbox failed: {message}")


class SessionTransport:
    """A ``spade.envs.remote.Transport`` over one real sandbox session, for the checker's thread.

    The checker runs in a worker thread; each request is run on the pool's event loop and waited
    for. Once the run is stopped, every request raises ``ValidationStopped``; an outcome
    ``sandbox_fault`` stops it (the sandbox failed, not the env).

    Args:
        open_session: ``pool.open_session`` (a coroutine function).
        loop: The pool's event loop.
        code: The env's code as submitted (the pool repairs it as for a play).
        setting: Game or tool.
        config: The validation's limits (the session's, as for a play).
        run: The validation this session belongs to.
    """

    def __init__(
        self,
        open_session: Callable[[str, str, int, CheckConfig], Coroutine[Any, Any, SandboxSession]],
        loop: asyncio.AbstractEventLoop,
        code: str,
        setting: Setting,
        config: CheckConfig,
        run: ValidationRun,
    ) -> None:
        self._open_session = open_session
        self._loop = loop
        self._code = code
        self._setting = setting
        self._config = config
        self._validation = run
        self.session: SandboxSession | None = None

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        stopped = self._validation.stopped
        if stopped.is_set():
            coro.close()
            raise ValidationStopped("the validation was stopped")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        while True:
            try:
                return future.result(timeout=0.2)
            except concurrent.futures.TimeoutError:
                if stopped.is_set():
                    future.cancel()
                    raise ValidationStopped("the validation was stopped") from None
            except (SandboxFault, RuntimeError) as exc:  # the pool's own failure (not started, no zygote)
                raise self._validation.failed(str(exc)) from None

    def _checked(self, reply: dict[str, Any]) -> dict[str, Any]:
        """``reply``, unless it is the sandbox's own fault (only an ``outcome`` reply carries a step outcome;
        a ``raised`` reply's ``outcome`` is the name of how the env's call ended)."""
        if reply.get("op") == "outcome":
            outcome = reply.get("outcome") or {}
            if outcome.get("outcome") == Outcome.SANDBOX_FAULT.value:
                raise self._validation.failed(str(outcome.get("observation", "")))
        return reply

    def _reply(self, outcome: StepOutcome) -> dict[str, Any]:
        assert self.session is not None
        return self._checked({**self.session.extras, "op": "outcome", "outcome": outcome.to_dict()})

    def open(self, seed: int) -> dict[str, Any]:
        self.session = self._run(self._open_session(self._code, self._setting.value, seed, self._config))
        return self._reply(self.session.initial)

    def send(self, message: dict[str, Any]) -> dict[str, Any]:
        session = self.session
        if session is None:
            raise RuntimeError("send() before open()")
        try:
            if message.get("op") == "step":
                return self._reply(self._run(session.step(str(message["action"]))))
            return self._checked(self._run(session.ask(message)))
        except SessionEnded:
            last = session.last or session.initial
            return {"op": "outcome", "outcome": last.to_dict()}

    def close(self) -> None:
        if self.session is not None and not self.session.closed:
            with contextlib.suppress(ValidationStopped, SandboxFault, RuntimeError):
                self._run(self.session.close())


async def validate_in_sessions(
    open_session: Callable[[str, str, int, CheckConfig], Coroutine[Any, Any, SandboxSession]],
    code: str,
    setting: str,
    config: CheckConfig,
    wall_seconds: float,
) -> ValidationReport:
    """Run ``spade.envs.check_env_source`` on ``code``, every episode it plays a real session.

    The checker runs in a worker thread of this process and never runs env code: each episode is a
    session opened by ``open_session`` (``SandboxPool.open_session``), the very path a rollout's
    play takes, so the env cannot tell a check from a play. Past ``wall_seconds`` the validation is
    stopped and the report names the check that was running.
    """
    loop = asyncio.get_running_loop()
    run = ValidationRun()
    parsed = Setting.parse(setting)
    running: list[str] = []
    finished: list[dict[str, Any]] = []

    def progress(name: str, result: dict[str, Any] | None = None) -> None:
        if result is None:
            running.append(name)
        else:
            finished.append(result)

    transports: list[SessionTransport] = []

    def connect(_repaired: str, env_setting: Setting, env_config: CheckConfig) -> SessionTransport:
        # The code as submitted, as a play submits it: the pool repairs it the same way for both.
        transports.append(SessionTransport(open_session, loop, code, env_setting, env_config, run))
        return transports[-1]

    def check() -> ValidationReport:
        runtime = RemoteRuntime(connect)
        try:
            return check_env_source(code, parsed, config, progress=progress, runtime=runtime)
        finally:
            runtime.close()

    start = time.perf_counter()
    task = asyncio.ensure_future(asyncio.to_thread(check))
    try:
        async with asyncio.timeout(wall_seconds):
            report = await asyncio.shield(task)
        if run.fault is not None:
            raise SandboxFault(f"sandbox fault during validation: {run.fault}")
        return report
    except TimeoutError:
        run.stopped.set()
        at_stop, done_at_stop = (running[-1] if running else None), list(finished)
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(task, STOP_GRACE_S)
    finally:  # whatever the checker's thread could not close (stopped, or it failed)
        for transport in transports:
            if transport.session is not None:
                await transport.session.close()
    if run.fault is not None:
        raise SandboxFault(f"sandbox fault during validation: {run.fault}")
    reason = f"the validation ran past its wall-clock limit of {wall_seconds:g} s"
    # ``code`` as received: the pool sets the report's repaired_code from its own (off-loop) repair.
    return stopped_report(parsed.value, code, at_stop, done_at_stop, reason, (time.perf_counter() - start) * 1000)


STOP_GRACE_S = 5.0
"""How long a stopped validation's thread is waited for (it ends at its next session request)."""
