"""Domain errors to wire statuses: the one table every service's HTTP and gRPC adapters use.

A core raises :class:`spade.errors.ServiceError` subclasses; the servers in this package answer
with the status of the error's :class:`~spade.errors.ErrorKind` and its message. Anything else a
handler raises is an internal error: logged with its traceback, answered without details.
"""

from __future__ import annotations

from collections.abc import Mapping

import grpc

from spade.errors import ErrorKind, ServiceError

HTTP_STATUS: Mapping[ErrorKind, int] = {
    ErrorKind.INVALID: 422,
    ErrorKind.NOT_FOUND: 404,
    ErrorKind.CONFLICT: 409,
    ErrorKind.UNAUTHENTICATED: 401,
    ErrorKind.FORBIDDEN: 403,
    ErrorKind.TOO_LARGE: 413,
    ErrorKind.QUOTA: 429,
    ErrorKind.UNAVAILABLE: 503,
    ErrorKind.INTERNAL: 500,
}
"""HTTP status of each kind."""

GRPC_STATUS: Mapping[ErrorKind, grpc.StatusCode] = {
    ErrorKind.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorKind.CONFLICT: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorKind.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    ErrorKind.FORBIDDEN: grpc.StatusCode.PERMISSION_DENIED,
    ErrorKind.TOO_LARGE: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.QUOTA: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.INTERNAL: grpc.StatusCode.INTERNAL,
}
"""gRPC status of each kind."""

ERROR_CODE_TRAILER = "error-code"
"""gRPC trailing metadata key of a refusal's stable code (the REST body's ``error.code``): it tells
apart refusals that share a status, such as ``payload_too_large`` and ``quota_exceeded`` (both
RESOURCE_EXHAUSTED; only a quota's also carries ``retry-after``)."""

ErrorKinds = Mapping[type[BaseException], tuple[ErrorKind, str]]
"""Errors a service raises that are not ``ServiceError`` subclasses (a library's, say): their kind and code."""


def classify(exc: BaseException, extra: ErrorKinds | None = None) -> tuple[ErrorKind, str] | None:
    """The kind and code of a domain error, or ``None`` for anything else (an internal failure).

    >>> from spade.auth import Unauthenticated
    >>> classify(Unauthenticated("no key"))
    (<ErrorKind.UNAUTHENTICATED: 'unauthenticated'>, 'unauthenticated')
    >>> classify(KeyError("x")) is None
    True
    """
    if isinstance(exc, ServiceError):
        return exc.kind, exc.code
    for cls in type(exc).__mro__:
        if extra and cls in extra:
            return extra[cls]
    return None
