"""Typed helpers: publish and decode the protobuf message each stream carries (``STREAMS``).

>>> from spade.queues.base import ENVS_READY
>>> from spade.v1 import queues_pb2
>>> decode(Delivery(ENVS_READY, "1-0", "k", queues_pb2.EnvReady(env_id="e1").SerializeToString(), 1))
env_id: "e1"
<BLANKLINE>
"""

from __future__ import annotations

from google.protobuf.message import DecodeError
from google.protobuf.message import Message as ProtoMessage

from spade.queues.base import STREAMS, Delivery, QueueError, WorkQueue

__all__ = ["decode", "message_type", "publish_proto"]


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
