"""Domain errors of the sandbox service and their single mapping to HTTP and gRPC status codes.

Every error message names the rule, the offending value and the fix. Messages never contain the
caller's code or a traceback.
"""

from __future__ import annotations

import grpc


class SandboxServiceError(Exception):
    """Base class: ``code`` is a stable machine-readable identifier, the message is for humans."""

    code = "internal"
    http_status = 500
    grpc_status = grpc.StatusCode.INTERNAL


class InvalidRequest(SandboxServiceError):
    code = "invalid_request"
    http_status = 422
    grpc_status = grpc.StatusCode.INVALID_ARGUMENT


class PayloadTooLarge(SandboxServiceError):
    code = "payload_too_large"
    http_status = 413
    grpc_status = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unauthenticated(SandboxServiceError):
    code = "unauthenticated"
    http_status = 401
    grpc_status = grpc.StatusCode.UNAUTHENTICATED


class Forbidden(SandboxServiceError):
    code = "forbidden"
    http_status = 403
    grpc_status = grpc.StatusCode.PERMISSION_DENIED


class QuotaExceeded(SandboxServiceError):
    code = "quota_exceeded"
    http_status = 429
    grpc_status = grpc.StatusCode.RESOURCE_EXHAUSTED


class SessionNotFound(SandboxServiceError):
    code = "session_not_found"
    http_status = 404
    grpc_status = grpc.StatusCode.NOT_FOUND


class SessionFinished(SandboxServiceError):
    code = "session_finished"
    http_status = 409
    grpc_status = grpc.StatusCode.FAILED_PRECONDITION


class ServiceUnavailable(SandboxServiceError):
    code = "unavailable"
    http_status = 503
    grpc_status = grpc.StatusCode.UNAVAILABLE
