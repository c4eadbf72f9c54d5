"""Domain errors of the memory; each adapter maps them to its status codes in one place."""

from __future__ import annotations


class MemoryServiceError(Exception):
    """Base of the memory's domain errors."""


class EnvironmentNotFound(MemoryServiceError):
    """No environment has the given id."""

    def __init__(self, env_id: str) -> None:
        super().__init__(f"no environment with id {env_id!r}; list ids with GET /v1/environments")
        self.env_id = env_id


class InvalidArgument(MemoryServiceError):
    """A request value breaks a rule; the message names the rule, the value and the fix."""
