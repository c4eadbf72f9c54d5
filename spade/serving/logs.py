"""One logging set-up for every service: JSON lines naming the service, tenant, env id and request id.

Every ``spade serve`` calls :func:`configure` once (the ``serve`` command group does it before the
service's own command runs), so each process writes one JSON object per line to stderr::

    {"ts": "2026-05-01T12:00:00.123Z", "level": "info", "service": "rollout", "logger": "spade.rollout",
     "message": "play", "event": "play", "request_id": "9f0c...", "env_id": "e-12", "return": 0.5}

- **Context**: :func:`log_context` binds fields (``request_id``, ``tenant``, ``env_id``, anything) to
  every line logged inside it, in this task and the tasks it starts; :func:`annotate` adds fields to
  the current context (the servers' authentication adds the tenant this way). The gRPC and HTTP
  servers of :mod:`spade.serving` open a context per call with the caller's ``x-request-id`` (or a
  new one) and send that id back (HTTP response header, gRPC trailing metadata).
- **Events**: :func:`log_event` writes one structured line (``event`` plus typed fields), the form of
  the per-play, per-attempt and per-step lines. A plain ``logger.info(msg, extra={...})`` works too:
  every ``extra`` field becomes a JSON key.
- **Noise**: libraries' INFO chatter (Alembic, httpx, uvicorn's start-up and access lines,
  SQLAlchemy, the Kubernetes client) is raised to WARNING unless the level is DEBUG.

Environment: ``SPADE_LOG_FORMAT`` (``json``, the default, or ``text`` for a terminal) and
``SPADE_LOG_LEVEL`` (``DEBUG``, ``INFO``, ...; default ``INFO``).

>>> import io, json as _json, logging
>>> out = io.StringIO()
>>> configure("demo", stream=out)
>>> with log_context(request_id="r-1", env_id="e-7"):
...     log_event(logging.getLogger("spade.demo"), "play", seed=3, reward=0.5)
>>> line = _json.loads(out.getvalue())
>>> (line["service"], line["event"], line["request_id"], line["env_id"], line["seed"], line["reward"])
('demo', 'play', 'r-1', 'e-7', 3, 0.5)
>>> reset()
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime as dt
import json
import logging
import os
import re
import sys
import uuid
from collections.abc import Iterator, Mapping
from typing import Any, TextIO

LOG_FORMAT_ENV = "SPADE_LOG_FORMAT"
LOG_LEVEL_ENV = "SPADE_LOG_LEVEL"

REQUEST_ID_HEADER = "x-request-id"
"""The HTTP header and gRPC metadata key carrying a request's id, both ways."""

NOISY_LOGGERS = (
    "alembic",
    "httpx",
    "httpcore",
    "uvicorn",
    "uvicorn.access",
    "uvicorn.error",
    "sqlalchemy",
    "kubernetes",
    "urllib3",
    "filelock",
    "asyncio",
)
"""Libraries whose INFO lines are noise in a service's log: WARNING and above only, unless DEBUG."""

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")

# The attributes every LogRecord has: anything else on a record came from ``extra``.
_RECORD_FIELDS = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "taskName"}

_CONTEXT: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("spade_log_context", default=None)

_HANDLER_MARK = "_spade_log_handler"


# -- context ------------------------------------------------------------------------------------------


def new_request_id() -> str:
    """A fresh request id (32 hex characters)."""
    return uuid.uuid4().hex


def accept_request_id(value: str | bytes | None) -> str:
    """The caller's request id when it is a sane one (1-128 of ``A-Za-z0-9._:-``), else a new id.

    >>> accept_request_id("abc-123")
    'abc-123'
    >>> len(accept_request_id("no spaces; or <html>"))
    32
    """
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    if value and _REQUEST_ID.match(value):
        return value
    return new_request_id()


@contextlib.contextmanager
def log_context(**fields: Any) -> Iterator[dict[str, Any]]:
    """Bind ``fields`` to every line logged inside the block (nested blocks add to the outer one).

    Yields the context's mutable field mapping: :func:`annotate` (or the caller) may add to it, and
    what is added shows in every later line of the block, including lines logged by an enclosing
    middleware once the block's inner code has filled in the tenant.
    """
    merged = {**(_CONTEXT.get() or {}), **{k: v for k, v in fields.items() if v is not None}}
    token = _CONTEXT.set(merged)
    try:
        yield merged
    finally:
        _CONTEXT.reset(token)


def enter_context(**fields: Any) -> dict[str, Any]:
    """Like :func:`log_context` for the rest of the current task (no block to close).

    For servers whose call handlers cannot wrap the call in a ``with`` (gRPC's streaming handlers
    run as async generators): each call runs in its own task, so the fields end with it.
    """
    merged = {**(_CONTEXT.get() or {}), **{k: v for k, v in fields.items() if v is not None}}
    _CONTEXT.set(merged)
    return merged


def annotate(**fields: Any) -> None:
    """Add ``fields`` to the current context (a call's tenant once authenticated, the env id once known).

    Outside any context this does nothing: there is no request to describe.
    """
    current = _CONTEXT.get()
    if current is not None:
        current.update({k: v for k, v in fields.items() if v is not None})


def current_context() -> Mapping[str, Any]:
    """The fields bound to the current context (empty outside one)."""
    return dict(_CONTEXT.get() or {})


def current_request_id() -> str | None:
    """The current call's request id, if any."""
    value = (_CONTEXT.get() or {}).get("request_id")
    return str(value) if value is not None else None


def tenant_name(principal: Any) -> str | None:
    """A principal's tenant name for logs: the principal itself when a string, else its ``name``/``tenant``."""
    if principal is None or isinstance(principal, str):
        return principal
    for attribute in ("name", "tenant"):
        value = getattr(principal, attribute, None)
        if isinstance(value, str):
            return value
    return None


# -- events -------------------------------------------------------------------------------------------


def log_event(
    logger: logging.Logger, event: str, text: str | None = None, /, *, level: int = logging.INFO, **fields: Any
) -> None:
    """One structured line: ``event`` is a field and the message (``text`` instead, when given); ``fields``
    become JSON keys.

    A field named like a ``LogRecord`` attribute (``name``, ``args``, ``message``, ...) is written with
    a trailing underscore (``name_``) instead of breaking the call.

    Example::

        log_event(log, "play", env_id=env.id, version=3, window_index=0, arm="hint", seed=7,
                  reward=1.0, turns=4, finish_reason="terminated", spec_id=spec.spec_id)
    """
    if not logger.isEnabledFor(level):
        return
    extra = {(f"{k}_" if k in _RECORD_FIELDS else k): v for k, v in fields.items()}
    extra["event"] = event
    logger.log(level, event if text is None else text, extra=extra, stacklevel=2)


# -- formatting ---------------------------------------------------------------------------------------


class _ContextFilter(logging.Filter):
    """Adds the service and the current context's fields to each record (explicit extras win)."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def filter(self, record: logging.LogRecord) -> bool:
        record.service = self.service
        for key, value in (_CONTEXT.get() or {}).items():
            if key not in record.__dict__:
                setattr(record, key, value)
        return True


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in record.__dict__.items() if k not in _RECORD_FIELDS and not k.startswith("_")}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts, level, service, logger, message, context fields, extras, exc."""

    def format(self, record: logging.LogRecord) -> str:
        ts = dt.datetime.fromtimestamp(record.created, dt.UTC)
        out: dict[str, Any] = {
            "ts": ts.strftime("%Y-%m-%dT%H:%M:%S.") + f"{ts.microsecond // 1000:03d}Z",
            "level": record.levelname.lower(),
            "service": getattr(record, "service", None),
            "logger": record.name,
            "message": record.getMessage(),
        }
        extras = _extras(record)
        extras.pop("service", None)
        out.update(extras)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exc"] = record.exc_text
        if record.stack_info:
            out["stack"] = record.stack_info
        return json.dumps(out, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """A terminal line: time, level, service, logger, message, then ``key=value`` for each field."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(service)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        if not hasattr(record, "service"):
            record.service = "-"
        line = super().format(record)
        extras = _extras(record)
        extras.pop("service", None)
        extras.pop("event", None)
        if extras:
            fields = " ".join(f"{k}={v}" for k, v in extras.items())
            head, sep, tail = line.partition("\n")  # keep a traceback below the fields
            line = f"{head} [{fields}]{sep}{tail}"
        return line


# -- set-up -------------------------------------------------------------------------------------------


def logger_name(module: str) -> str:
    """The one naming scheme of loggers, ``spade.<service or package>.<module>``, from ``__name__``.

    >>> logger_name("services.rollout.worker"), logger_name("spade.inference.client")
    ('spade.rollout.worker', 'spade.inference.client')
    """
    head, _, rest = module.partition(".")
    return f"spade.{rest}" if head == "services" and rest else module


def get_logger(module: str) -> logging.Logger:
    """``logging.getLogger`` under :func:`logger_name`: every module's logger is ``get_logger(__name__)``."""
    return logging.getLogger(logger_name(module))


def _level(value: str | int) -> int:
    if isinstance(value, int):
        return value
    level = logging.getLevelNamesMapping().get(value.strip().upper())
    if level is None:
        raise ValueError(
            f"log level {value!r} is not one of DEBUG, INFO, WARNING, ERROR, CRITICAL; set {LOG_LEVEL_ENV} to one"
        )
    return level


def configure(
    service: str,
    *,
    json: bool = True,
    level: str | int = "INFO",
    stream: TextIO | None = None,
) -> None:
    """Send every log line of this process to ``stream`` (stderr), as JSON or text, for ``service``.

    Replaces whatever handler an earlier call installed (so calling it twice is harmless) and any
    handler ``logging.basicConfig`` put on the root logger; a later ``basicConfig`` is then a no-op.

    Args:
        service: The service's name on every line (``sandbox``, ``rollout``, ...).
        json: JSON lines (default) or a readable text line per record.
        level: Root level (a name or a number).
        stream: Where lines go (default ``sys.stderr``).

    Raises:
        ValueError: An unknown level name.
    """
    root = logging.getLogger()
    numeric = _level(level)
    for existing in list(root.handlers):
        # Ours from an earlier call, or basicConfig's plain stream handler (not a test harness's).
        if getattr(existing, _HANDLER_MARK, False) or type(existing) is logging.StreamHandler:
            root.removeHandler(existing)
    handler = logging.StreamHandler(stream or sys.stderr)
    setattr(handler, _HANDLER_MARK, True)
    handler.addFilter(_ContextFilter(service))
    handler.setFormatter(JsonFormatter() if json else TextFormatter())
    root.addHandler(handler)
    root.setLevel(numeric)
    quiet = logging.WARNING if numeric > logging.DEBUG else logging.NOTSET
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(quiet)


def configure_from_env(
    service: str,
    environ: Mapping[str, str] | None = None,
    *,
    level: str | int | None = None,
    default_format: str = "json",
) -> None:
    """:func:`configure` with ``SPADE_LOG_FORMAT`` (``json``/``text``) and ``SPADE_LOG_LEVEL``.

    ``level`` (a command's ``--log-level``), when given, wins over ``SPADE_LOG_LEVEL``. A service
    logs JSON unless told otherwise; a command a person runs in a terminal (``spade run``, ``spade
    eval``, set-up) passes ``default_format="text"``, and ``SPADE_LOG_FORMAT`` still decides.

    Raises:
        ValueError: A value is not one of the allowed ones (the message names the variable).
    """
    env = os.environ if environ is None else environ
    fmt = env.get(LOG_FORMAT_ENV, default_format).strip().lower() or default_format
    if fmt not in ("json", "text"):
        raise ValueError(f"{LOG_FORMAT_ENV}={fmt!r} is not a log format; set it to json or text")
    configure(service, json=fmt == "json", level=level or env.get(LOG_LEVEL_ENV, "INFO") or "INFO")


def reset() -> None:
    """Remove the handler :func:`configure` installed (tests)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, _HANDLER_MARK, False):
            root.removeHandler(handler)
