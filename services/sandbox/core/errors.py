"""Domain errors of the sandbox service.

Each names its :class:`spade.errors.ErrorKind` and a stable ``code``; the HTTP and gRPC statuses of
each kind live in ``spade.serving.errors`` (the one mapping every adapter uses). Every message names
the rule, the offending value and the fix, and never contains the caller's code or a traceback.
"""

from __future__ import annotations

from spade.auth import Forbidden, Unauthenticated
from spade.errors import ErrorKind, InvalidInput, ServiceError

__all__ = [
    "Forbidden",
    "InvalidRequest",
    "PayloadTooLarge",
    "QuotaExceeded",
    "SandboxServiceError",
    "ServiceUnavailable",
    "SessionFinished",
    "SessionNotFound",
    "Unauthenticated",
]


class SandboxServiceError(ServiceError):
    """Base class: ``code`` is a stable machine-readable identifier, the message is for humans."""


class InvalidRequest(SandboxServiceError, InvalidInput):
    """A request value breaks a rule (``spade.errors.InvalidInput``: REST 422, gRPC INVALID_ARGUMENT)."""

    kind = ErrorKind.INVALID
    code = "invalid_request"


class PayloadTooLarge(SandboxServiceError):
    kind = ErrorKind.TOO_LARGE
    code = "payload_too_large"


class QuotaExceeded(SandboxServiceError):
    """Over a quota or a rate.

    Attributes:
        retry_after_s: When a retry can succeed, in seconds (the HTTP ``Retry-After`` header and the
            gRPC ``retry-after`` trailer carry it, rounded up).
    """

    kind = ErrorKind.QUOTA
    code = "quota_exceeded"

    def __init__(self, message: str, *, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class SessionNotFound(SandboxServiceError):
    kind = ErrorKind.NOT_FOUND
    code = "session_not_found"


class SessionFinished(SandboxServiceError):
    kind = ErrorKind.CONFLICT
    code = "session_finished"


class ServiceUnavailable(SandboxServiceError):
    kind = ErrorKind.UNAVAILABLE
    code = "unavailable"
