"""One retry policy for every service: a typed settings record and the tenacity retryers built from it.

Every place that retries on purpose (a queue reconnecting, the inference client, the weight
publisher, a sandbox call, a play after a sandbox fault) takes a :class:`RetryPolicy` from its
settings and asks it for a retryer; nothing hand-writes a backoff loop. Redis clients get the same
policy as redis-py's own :class:`redis.retry.Retry`, so the library retries and we do not retry
around it.

>>> policy = RetryPolicy(attempts=3, initial_s=0.0, max_s=0.0, jitter_s=0.0)
>>> calls = []
>>> def flaky() -> str:
...     calls.append(1)
...     if len(calls) < 3:
...         raise ConnectionError("down")
...     return "up"
>>> for attempt in policy.retrying(ConnectionError):
...     with attempt:
...         result = flaky()
>>> result, len(calls)
('up', 3)
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import tenacity
from pydantic import BaseModel, ConfigDict, Field, model_validator

RetryOn = type[BaseException] | tuple[type[BaseException], ...] | Callable[[BaseException], bool]
"""What is worth another try: exception types, or a predicate over the exception."""


class RetryPolicy(BaseModel):
    """How often and how patiently to retry a call that failed for a transient reason.

    The wait before try ``n + 1`` is ``min(max_s, initial_s * multiplier ** (n - 1))`` plus a random
    ``[0, jitter_s)``, so replicas that failed together do not retry together.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    attempts: int = Field(4, ge=1, le=1000, description="Tries in all, the first one included (1: never retry).")
    initial_s: float = Field(0.5, ge=0.0, le=600.0, description="Wait before the second try, in seconds.")
    multiplier: float = Field(2.0, ge=1.0, le=10.0, description="Each wait is the previous one times this.")
    max_s: float = Field(10.0, ge=0.0, le=3600.0, description="Longest wait between two tries, in seconds.")
    jitter_s: float = Field(0.25, ge=0.0, le=600.0, description="Random extra wait in [0, jitter_s) per try.")

    @model_validator(mode="after")
    def _ordered(self) -> RetryPolicy:
        if self.max_s < self.initial_s:
            raise ValueError(f"max_s={self.max_s} is below initial_s={self.initial_s}: raise max_s or lower initial_s")
        return self

    def _kwargs(self, retry_on: RetryOn, logger: logging.Logger | None, what: str) -> dict[str, Any]:
        if isinstance(retry_on, type | tuple):
            condition: tenacity.retry_base = tenacity.retry_if_exception_type(retry_on)
        else:
            condition = tenacity.retry_if_exception(retry_on)
        kwargs: dict[str, Any] = {
            "stop": tenacity.stop_after_attempt(self.attempts),
            "wait": tenacity.wait_exponential_jitter(
                multiplier=self.initial_s, max=self.max_s, exp_base=self.multiplier, jitter=self.jitter_s
            ),
            "retry": condition,
            "reraise": True,
        }
        if logger is not None:

            def before_sleep(state: tenacity.RetryCallState) -> None:
                exc = state.outcome.exception() if state.outcome is not None else None
                wait = state.next_action.sleep if state.next_action is not None else 0.0
                logger.warning(
                    "%s failed (try %d of %d: %s); retrying in %.2f s",
                    what,
                    state.attempt_number,
                    self.attempts,
                    exc,
                    wait,
                )

            kwargs["before_sleep"] = before_sleep
        return kwargs

    def retrying(
        self, retry_on: RetryOn, *, logger: logging.Logger | None = None, what: str = "call"
    ) -> tenacity.Retrying:
        """A synchronous retryer: ``for attempt in policy.retrying(E): with attempt: ...``.

        The last failure is re-raised as itself (not wrapped) once the tries are spent.
        """
        return tenacity.Retrying(**self._kwargs(retry_on, logger, what))

    def async_retrying(
        self, retry_on: RetryOn, *, logger: logging.Logger | None = None, what: str = "call"
    ) -> tenacity.AsyncRetrying:
        """An asyncio retryer: ``async for attempt in policy.async_retrying(E): with attempt: ...``."""
        return tenacity.AsyncRetrying(**self._kwargs(retry_on, logger, what))

    def redis_retry(self) -> Any:
        """The same policy as redis-py's ``Retry`` (asyncio client), for ``redis.asyncio.Redis(retry=...)``."""
        from redis.asyncio.retry import Retry
        from redis.backoff import ExponentialWithJitterBackoff

        return Retry(ExponentialWithJitterBackoff(base=max(self.initial_s, 1e-3), cap=self.max_s), self.attempts - 1)
