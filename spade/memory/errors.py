"""Domain errors of the memory; their kinds map to HTTP and gRPC statuses in ``spade.serving.errors``."""

from __future__ import annotations

from spade.errors import ErrorKind, ServiceError, Unavailable


class MemoryServiceError(ServiceError):
    """Base of the memory's domain errors."""


class EnvironmentNotFound(MemoryServiceError):
    """No environment has the given id."""

    kind = ErrorKind.NOT_FOUND
    code = "not_found"

    def __init__(self, env_id: str) -> None:
        super().__init__(f"no environment with id {env_id!r}; list ids with GET /v1/environments")
        self.env_id = env_id


class InvalidArgument(MemoryServiceError):
    """A request value breaks a rule; the message names the rule, the value and the fix."""

    kind = ErrorKind.INVALID
    code = "invalid_request"


class MemoryUnavailable(MemoryServiceError, Unavailable):
    """The memory could not be reached (not started yet, restarting, its name not resolvable yet, a
    call past its deadline): a caller that waits for the memory anyway may try again."""


class DatabaseUnavailable(MemoryUnavailable):
    """The memory's database did not answer (down, restarting, the connection dropped): the memory
    answers UNAVAILABLE, not an internal error, so its callers wait and retry as for the memory itself
    (its writes are idempotent: plays by trajectory id, attempts by sample id)."""

    kind = ErrorKind.UNAVAILABLE
    code = "database_unavailable"


class RunSpecNotSet(MemoryServiceError):
    """No run spec is stored yet (``spade runspec set FILE``, or a service started with one, stores it)."""

    kind = ErrorKind.NOT_FOUND
    code = "runspec_not_set"

    def __init__(self, message: str = "") -> None:
        super().__init__(message or "no run spec is stored in the memory yet: store one with `spade runspec set FILE`")


class RunSpecConflict(MemoryServiceError):
    """A different run spec is already stored, or the spec contradicts the memory's own settings."""

    kind = ErrorKind.CONFLICT
    code = "runspec_conflict"
