"""Typed helpers: publish and decode the protobuf message each stream carries (``STREAMS``).

>>> from spade.queues.base import ENVS_READY
>>> from spade.v1 import queues_pb2
>>> decode(Delivery(ENVS_READY, "1-0", "k", queues_pb2.EnvReady(env_id="e1").SerializeToString(), 1))
env_id: "e1"
<BLANKLINE>
"""

from __future__ import annotations

from collections.abc import Sequence

from google.protobuf.message import DecodeError
from google.protobuf.message import Message as ProtoMessage

from spade.queues.base import STREAMS, Delivery, QueueError, WorkQueue

__all__ = ["decode", "message_type", "publish_proto", "publish_protos"]


def message_type(stream: str) -> type[ProtoMessage]:
    """Return the protobuf class ``stream`` carries.

    Raises:
        KeyError: ``stream`` is not one of ``STREAMS`` (the message names the known ones).
    """
    try:
        return STREAMS[stream]
    except KeyError:
        raise KeyError(f"unknown stream {stream!r}; known streams: {sorted(STREAMS)}") from None


async def publish_proto(
    queue: WorkQueue, stream: str, msg: ProtoMessage, *, key: str, timeout_s: float | None = None
) -> str:
    """Serialise ``msg`` and publish it to ``stream`` (idempotent by ``key``); return the message id.

    Raises:
        TypeError: ``msg`` is not the message type ``stream`` carries.
        KeyError: Unknown stream.
        QueueFull: See ``WorkQueue.publish``.
    """
    expected = message_type(stream)
    if not isinstance(msg, expected):
        raise TypeError(
            f"stream {stream!r} carries {expected.DESCRIPTOR.full_name}, got {type(msg).__name__}; "
            "publish the message type listed in spade.queues.base.STREAMS"
        )
    return await queue.publish(stream, msg.SerializeToString(), key=key, timeout_s=timeout_s)


async def publish_protos(
    queue: WorkQueue, stream: str, messages: Sequence[tuple[str, ProtoMessage]], *, timeout_s: float | None = None
) -> list[str]:
    """Serialise ``(key, msg)`` pairs and publish them to ``stream`` in one batch (``WorkQueue.publish_many``).

    For producers that make many messages at once (a group's agent samples, a round's designer
    samples): one round trip instead of one per message, with the same per-message guarantees.

    Raises:
        TypeError: A message is not the type ``stream`` carries (nothing is published then).
        KeyError: Unknown stream.
        QueueFull: See ``WorkQueue.publish_many``.
    """
    expected = message_type(stream)
    for _, msg in messages:
        if not isinstance(msg, expected):
            raise TypeError(
                f"stream {stream!r} carries {expected.DESCRIPTOR.full_name}, got {type(msg).__name__}; "
                "publish the message type listed in spade.queues.base.STREAMS"
            )
    payloads = [(key, msg.SerializeToString()) for key, msg in messages]
    return await queue.publish_many(stream, payloads, timeout_s=timeout_s)


def decode(delivery: Delivery) -> ProtoMessage:
    """Parse a delivery's payload into the message type of its stream.

    Raises:
        QueueError: The payload is not a valid message of that type (a producer bug; do not retry).
    """
    msg = message_type(delivery.stream)()
    try:
        msg.ParseFromString(delivery.payload)
    except DecodeError as exc:
        raise QueueError(
            f"message {delivery.message_id} on {delivery.stream!r} is not a valid {msg.DESCRIPTOR.full_name}: {exc}"
        ) from exc
    return msg
