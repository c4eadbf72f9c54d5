"""Queue backends' settings as a discriminated union (``spade.queues.factory.make_queue`` builds one).

Every service's settings hold one ``queue: QueueConfig`` field (``SPADE_<SERVICE>_QUEUE__URL=...``);
``make_queue`` turns it into a ``WorkQueue``. The backend is chosen once, by the ``kind`` tag —
nothing else in a service knows which one runs. Without a ``kind`` the queue is Redis (the
distributed default; the embedded run passes ``kind: inprocess``).

>>> cfg = QueueConfigAdapter.validate_python({"kind": "inprocess", "max_len": 10})
>>> type(cfg).__name__, cfg.max_len
('InProcessQueueConfig', 10)
>>> QueueConfigAdapter.validate_python({"url": "redis://redis:6379/0"}).kind
'redis'
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, TypeAdapter

from spade.retry import RetryPolicy

DEFAULT_REDIS_RETRY = RetryPolicy(attempts=9, initial_s=0.05, multiplier=2.0, max_s=2.0, jitter_s=0.05)
"""Retries of one Redis command after a dropped connection or a silent server (redis-py's own ``Retry``)."""


class _CommonQueueConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_len: int = Field(
        default=10_000,
        ge=1,
        le=10_000_000,
        description="Back-pressure bound: the most unacknowledged-or-unread messages a stream holds.",
    )
    publish_timeout_s: float = Field(
        default=30.0,
        ge=0.0,
        le=3600.0,
        description="Default time a publish waits for room in a full stream before raising QueueFull.",
    )
    claim_idle_ms: int = Field(
        default=60_000,
        ge=1,
        le=86_400_000,
        description="A pending message idle this long (its consumer presumed dead) is re-delivered.",
    )
    idempotency_ttl_s: int = Field(
        default=86_400,
        ge=1,
        le=30 * 86_400,
        description="How long a publish key is remembered: a retried publish within it stores nothing new.",
    )


class RedisQueueConfig(_CommonQueueConfig):
    """Redis Streams with consumer groups (distributed mode)."""

    kind: Literal["redis"] = "redis"
    url: str = Field(default="redis://127.0.0.1:6379/0", description="Redis URL (redis:// or rediss://).")
    prefix: str = Field(
        default="spade:",
        max_length=200,
        description="Prefix of every Redis key this queue writes; distinct prefixes are distinct queues.",
    )
    retry: RetryPolicy = Field(
        default=DEFAULT_REDIS_RETRY,
        description="Tries of one Redis command after a dropped connection or a reply slower than "
        "socket_timeout_s, with their back-off (redis-py retries on a fresh connection).",
    )
    socket_timeout_s: float = Field(
        default=30.0,
        ge=2.0,
        le=3600.0,
        description="A Redis reply slower than this counts as a dropped connection (and is retried); "
        "blocking reads are capped just below it, so a silently vanished server is noticed.",
    )


class InProcessQueueConfig(_CommonQueueConfig):
    """The asyncio in-process queue (embedded mode: one process runs every role)."""

    kind: Literal["inprocess"] = "inprocess"


def _kind(value: Any) -> str:
    """The ``kind`` tag of a queue config; absent means ``redis`` (``SPADE_X_QUEUE__URL=...`` alone)."""
    if isinstance(value, dict):
        return str(value.get("kind", "redis"))
    return str(getattr(value, "kind", "redis"))


QueueConfig = Annotated[
    Annotated[RedisQueueConfig, Tag("redis")] | Annotated[InProcessQueueConfig, Tag("inprocess")],
    Discriminator(_kind),
]
"""The queue backend of a service, tagged by ``kind`` (``redis``, the default, or ``inprocess``)."""

QueueConfigAdapter: TypeAdapter[RedisQueueConfig | InProcessQueueConfig] = TypeAdapter(QueueConfig)
"""Validates a plain mapping (from YAML, env, CLI) into a ``QueueConfig`` variant."""
