"""The lifecycle lines every service logs, at info level, through :func:`spade.serving.logs.log_event`.

One logger (``spade.serving.lifecycle``) and one event name per phase, so an operator greps one word across
every service's log (docs/distributed.md, "What you should see in the first five minutes"):

- ``started``: the service is serving or working; a short summary of its settings (addresses, the
  run spec, its identity). The full settings follow at DEBUG (``settings`` event).
- ``took_over``: a worker took over another worker's work (whose, why: its lease lapsed).
- ``resumed``: a service picked up durable state (which checkpoint, how much journal).
- ``stopping``: the first SIGTERM/SIGINT arrived (:func:`spade.serving.run.run_until_signalled`
  logs it, naming the signal).
- ``stopped``: the service's main coroutine returned; the signal that stopped it, what it finished
  (a service adds that with :func:`note_finished` before it returns), and how long the stop took.

>>> import io, json, logging
>>> from spade.serving import logs
>>> out = io.StringIO()
>>> logs.configure("demo", stream=out)
>>> started("demo serving", port=1234)
>>> line = json.loads(out.getvalue())
>>> (line["event"], line["level"], line["message"], line["port"])
('started', 'info', 'demo serving', 1234)
>>> logs.reset()
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from spade.redact import redact
from spade.serving.logs import get_logger, log_event

log = get_logger(__name__)

_finished: dict[str, Any] = {}
"""What the service finished while stopping (:func:`note_finished`), for the ``stopped`` line."""
_said: list[str] = []
"""The service's own words for its stop (:func:`note_finished`), at most one."""


def _line(event: str, message: str, fields: Mapping[str, Any]) -> None:
    log_event(log, event, message, **fields)


def started(message: str, /, *, settings: Any = None, **summary: Any) -> None:
    """``started``: ``message`` with a short ``summary`` (fields); ``settings`` in full at DEBUG only.

    Args:
        message: One readable sentence (``memory serving: gRPC 127.0.0.1:50052, REST ...``).
        settings: The service's settings (a pydantic model or a mapping), logged at DEBUG.
        summary: The few fields an operator checks (ports, spec id, consumer name).
    """
    _line("started", message, summary)
    if settings is not None and log.isEnabledFor(logging.DEBUG):
        dump = settings.model_dump(mode="json") if hasattr(settings, "model_dump") else dict(settings)
        log_event(log, "settings", level=logging.DEBUG, settings=_scrub(dump))


def _scrub(value: Any) -> Any:
    """``value`` with the password of every ``scheme://user:password@host`` URL in it masked.

    >>> _scrub({"url": "postgresql://spade:s3cret@db:5432/spade", "n": 1})
    {'url': 'postgresql://spade:***@db:5432/spade', 'n': 1}
    """
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {k: _scrub(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_scrub(v) for v in value]
    return value


def took_over(message: str, /, **fields: Any) -> None:
    """``took_over``: whose work, and why (``from_owner``, ``reason``)."""
    _line("took_over", message, fields)


def resumed(message: str, /, **fields: Any) -> None:
    """``resumed``: which durable state (``checkpoint``, ``journal_messages``, ...)."""
    _line("resumed", message, fields)


def stopping(signal_name: str) -> None:
    """``stopping``: the signal that asked the service to stop."""
    _line("stopping", f"{signal_name} received: stopping", {"signal": signal_name})


def note_finished(text: str | None = None, /, **fields: Any) -> None:
    """Record what the service finished while stopping, for its ``stopped`` line.

    Args:
        text: The service's own words (``learner stopped at weight version 4``); default ``stopped``.
        fields: Figures (``slots_handed_back=1``, ``checkpointed=4``); a later call adds to them.
    """
    if text is not None:
        _said[:] = [text]
    _finished.update(fields)


def begin() -> None:
    """Forget what an earlier run in this process noted as finished: a run's ``stopped`` line reports
    only its own stop (:func:`spade.serving.run.run_until_signalled` calls this first)."""
    _finished.clear()
    _said.clear()


def stopped(signal_name: str | None, elapsed_s: float | None = None) -> None:
    """``stopped``: the signal (``None``: the service ended by itself), what it finished, the stop's duration."""
    finished = dict(_finished)
    said = _said[0] if _said else "stopped"
    _finished.clear()
    _said.clear()
    what = ", ".join(f"{k}={v}" for k, v in finished.items())
    cause = f"on {signal_name}" if signal_name else "by itself (no signal)"
    message = f"{said}, {cause}" + (f": {what}" if what else "")
    fields: dict[str, Any] = {"signal": signal_name, "finished": finished}
    if elapsed_s is not None:
        fields["stop_s"] = round(elapsed_s, 3)
    _line("stopped", message, fields)
