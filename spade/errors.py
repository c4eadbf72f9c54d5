"""Domain errors that cross a service's boundary: what went wrong, as a kind every adapter understands.

A service's core raises subclasses of :class:`ServiceError`; each names its :class:`ErrorKind` (what
a caller should do about it) and a stable machine-readable ``code``. The core never imports a wire
library: ``spade.serving.errors`` maps each kind to an HTTP status and a gRPC status, in that one
place, for every service.

>>> class EnvGone(ServiceError):
...     kind = ErrorKind.NOT_FOUND
...     code = "env_not_found"
>>> err = EnvGone("no environment 'x': list ids with GET /v1/environments")
>>> err.kind.value, err.code, str(err)
('not_found', 'env_not_found', "no environment 'x': list ids with GET /v1/environments")
"""

from __future__ import annotations

import enum
from typing import ClassVar


class ErrorKind(enum.StrEnum):
    """What a failed request means for its caller (each maps to one HTTP and one gRPC status)."""

    INVALID = "invalid"
    """The request breaks a rule: fix it; retrying the same request cannot help."""
    NOT_FOUND = "not_found"
    """What the request names does not exist (or no longer does)."""
    CONFLICT = "conflict"
    """The request does not fit the current state (a finished session, say)."""
    UNAUTHENTICATED = "unauthenticated"
    """No credentials, or unknown ones."""
    FORBIDDEN = "forbidden"
    """Known caller, not allowed to do this."""
    TOO_LARGE = "too_large"
    """The request is over a size limit."""
    QUOTA = "quota"
    """The caller is over its quota or rate: retry later, with back-off."""
    UNAVAILABLE = "unavailable"
    """The service cannot serve now (overloaded, shutting down): retry later, elsewhere if possible."""
    INTERNAL = "internal"
    """The service failed; the details are in its log, never in the answer."""


class ServiceError(Exception):
    """Base of every domain error a service reports to its callers.

    The message is for a person: it names the rule, the value and the fix, and never carries a
    traceback or the caller's code.

    Attributes:
        kind: What the failure means for the caller (mapped to a status by ``spade.serving``).
        code: Stable machine-readable identifier, sent as ``error.code`` in REST bodies.
    """

    kind: ClassVar[ErrorKind] = ErrorKind.INTERNAL
    code: ClassVar[str] = "internal"


class Unavailable(ServiceError):
    """A dependency could not be reached, or cannot serve now: a caller may wait and try again.

    Every client raises a subclass for an unreachable dependency (the memory, the inference servers,
    a database or queue a service waits for), so one ``isinstance`` check tells an outage from a
    failure of the work itself.
    """

    kind: ClassVar[ErrorKind] = ErrorKind.UNAVAILABLE
    code: ClassVar[str] = "unavailable"


class InvalidInput(ServiceError):
    """A request breaks a rule: a field's value, or the message itself (malformed protobuf, say).

    The one refusal of bad caller input (REST 422, gRPC INVALID_ARGUMENT); a service's own invalid-
    request error extends it. The message names the field, the rule and the fix.

    Attributes:
        field: The offending field as the caller named it (``files[a.txt]``), or ``None`` for the
            message as a whole.
    """

    kind: ClassVar[ErrorKind] = ErrorKind.INVALID
    code: ClassVar[str] = "invalid_request"

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


def require_text(value: str, field: str, error: type[InvalidInput] = InvalidInput) -> str:
    """``value`` if it is Unicode text that UTF-8 can carry; else ``error`` (an :class:`InvalidInput`) naming ``field``.

    A JSON string may hold a lone surrogate (``"\\ud800"``), which no UTF-8 byte sequence encodes:
    refused here, at the door, before anything tries to encode it.

    >>> require_text("héllo", "stdin")
    'héllo'
    >>> try:
    ...     require_text("a\\ud800", "stdin")
    ... except InvalidInput as refused:
    ...     print(refused.field, "|", str(refused)[:71])
    stdin | 'stdin' is not valid Unicode text: a lone surrogate (U+D800) at index 1
    """
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        char = value[exc.start]
        raise error(
            f"{field!r} is not valid Unicode text: a lone surrogate (U+{ord(char):04X}) at index {exc.start}; "
            "send UTF-8 text (a JSON \\u escape of a surrogate must be one of a pair)",
            field=field,
        ) from None
    return value
