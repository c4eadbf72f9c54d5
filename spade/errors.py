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
