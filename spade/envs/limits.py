"""Guards around every call into env code: a per-call wall-clock limit and captured output.

The time limit uses ``signal.setitimer`` (SIGALRM), so it works only in the main thread of a
process; elsewhere calls run unguarded and the sandbox's process-level limits apply. Standard
library only.
"""

from __future__ import annotations

import contextlib
import io
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

ENV_FILENAME = "<spade-env>"
"""The filename env code is compiled under, so its frames can be told apart in tracebacks."""

_OUTPUT_CAP = 64_000
_REFIRE_S = 0.05


# A BaseException, not an Exception: env code's `except Exception` must not swallow it.
class CallTimeout(BaseException):
    """A call into env code ran past its time limit."""


class _CappedWriter(io.StringIO):
    """Keeps at most ``_OUTPUT_CAP`` characters of what env code prints; drops the rest."""

    def write(self, s: str) -> int:
        room = _OUTPUT_CAP - self.tell()
        if room > 0:
            super().write(s[:room])
        return len(s)


def timers_available() -> bool:
    """Whether per-call time limits can be enforced here (main thread, SIGALRM available)."""
    return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def guarded(seconds: float) -> Iterator[_CappedWriter]:
    """Run the block with a ``seconds`` time limit (raising ``CallTimeout``) and with stdout/stderr
    captured, so env prints cannot corrupt a sandbox protocol on stdout."""
    sink = _CappedWriter()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        if not timers_available():
            yield sink
            return
        fired = False

        def on_alarm(signum: int, frame: Any) -> None:
            nonlocal fired
            fired = True
            raise CallTimeout(f"call took longer than {seconds:g} s")

        old_handler = signal.signal(signal.SIGALRM, on_alarm)
        old_delay, old_interval = signal.setitimer(signal.ITIMER_REAL, 0)
        delay = min(seconds, old_delay) if old_delay > 0 else seconds
        started = time.monotonic()
        # Re-fire until the block exits, in case env code swallows the first alarm with a bare except.
        signal.setitimer(signal.ITIMER_REAL, delay, _REFIRE_S)
        try:
            yield sink
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old_handler)
            if old_delay > 0:
                remaining = max(old_delay - (time.monotonic() - started), 1e-3)
                signal.setitimer(signal.ITIMER_REAL, remaining, old_interval)
        if fired:  # The env swallowed the alarm and still returned: the call was over its limit anyway.
            raise CallTimeout(f"call took longer than {seconds:g} s")


def describe_exception(exc: BaseException, limit: int = 300) -> str:
    """``"Type: message (env code line N)"``: short, with no framework traceback or file paths."""
    line = None
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == ENV_FILENAME:
            line = tb.tb_lineno
        tb = tb.tb_next
    if isinstance(exc, SyntaxError) and exc.filename == ENV_FILENAME:
        line = exc.lineno
        text = f"SyntaxError: {exc.msg}"
    else:
        message = str(exc)
        text = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    if line is not None:
        text += f" (env code line {line})"
    return text if len(text) <= limit else text[: limit - 3] + "..."
