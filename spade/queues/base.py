"""The work-queue interface shared by every service.

Two implementations honour the same contract: Redis Streams with consumer groups (distributed mode)
and an in-process queue (embedded mode). Semantics:

- ``publish`` is idempotent by ``key``: publishing the same key twice to a stream stores one message.
- ``publish_many`` publishes a batch in one round trip (Redis: one script call per chunk) with the same
  guarantees per message; on ``QueueFull`` a leading part of the batch may be stored, and retrying
  the whole batch is safe (idempotent). ``ack_many`` acknowledges a batch in one round trip.
- When a stream holds ``max_len`` unacknowledged-or-unread messages, ``publish`` waits up to its
  ``timeout_s`` for room and then raises ``QueueFull``; it never drops a message silently.
- ``consume`` delivers each message to one consumer of a group; a message stays pending until
  ``ack``; a pending message whose consumer went silent for ``claim_idle_ms`` is re-delivered to
  another consumer of the group (its ``deliveries`` count grows).
- Payloads are serialised protobuf messages from ``proto/spade/v1/queues.proto``; ``STREAMS`` maps
  each stream to its message type.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from google.protobuf.message import Message as ProtoMessage

from spade.v1 import queues_pb2

ENVS_READY = "envs.ready"
SAMPLES_AGENT = "samples.agent"
SAMPLES_DESIGNER = "samples.designer"
WEIGHTS_PUBLISHED = "weights.published"
ENVS_AUDITED = "envs.audited"

STREAMS: dict[str, type[ProtoMessage]] = {
    ENVS_READY: queues_pb2.EnvReady,
    SAMPLES_AGENT: queues_pb2.AgentSample,
    SAMPLES_DESIGNER: queues_pb2.DesignerSample,
    WEIGHTS_PUBLISHED: queues_pb2.WeightsPublished,
    ENVS_AUDITED: queues_pb2.EnvAudit,
}


class QueueError(Exception):
    """Base class of queue failures."""


class QueueFull(QueueError):
    """The stream is at its bound and stayed full for the whole publish timeout."""


@dataclass(frozen=True)
class Delivery:
    """One delivered message.

    Attributes:
        stream: Stream name.
        message_id: Backend id, used to ``ack``.
        key: The idempotency key given to ``publish``.
        payload: Serialised protobuf message.
        deliveries: How many times this message has been delivered (1 on first delivery).
    """

    stream: str
    message_id: str
    key: str
    payload: bytes
    deliveries: int


class WorkQueue(Protocol):
    """The queue contract (see the module docstring)."""

    async def publish(self, stream: str, payload: bytes, *, key: str, timeout_s: float | None = None) -> str:
        """Append a message (idempotent by ``key``); returns its message id."""
        ...

    async def consume(
        self, stream: str, group: str, consumer: str, *, count: int = 1, block_ms: int = 1000
    ) -> list[Delivery]:
        """Deliver up to ``count`` messages to ``consumer`` (re-delivering stale pending ones first)."""
        ...

    async def publish_many(
        self, stream: str, messages: Sequence[tuple[str, bytes]], *, timeout_s: float | None = None
    ) -> list[str]:
        """Append ``(key, payload)`` messages in order (each idempotent by key); their ids, in order."""
        ...

    async def ack(self, stream: str, group: str, message_id: str) -> None:
        """Mark a delivered message done for ``group``."""
        ...

    async def ack_many(self, stream: str, group: str, message_ids: Sequence[str]) -> None:
        """Mark delivered messages done for ``group`` (one round trip)."""
        ...

    async def pending(self, stream: str, group: str) -> int:
        """Number of delivered but unacknowledged messages of ``group``."""
        ...

    async def length(self, stream: str) -> int:
        """Messages ``stream`` holds: unread by some group or unacknowledged (what ``max_len`` bounds)."""
        ...

    async def close(self) -> None:
        """Release connections."""
        ...
