"""Work queues: one contract (``base``), Redis Streams and in-process implementations, a factory.

Typical use::

    queue = make_queue(settings.queue)
    await publish_proto(queue, ENVS_READY, queues_pb2.EnvReady(env_id=...), key=env_id)
    for d in await queue.consume(ENVS_READY, "rollout", worker_id, count=8):
        handle(decode(d)); await queue.ack(d.stream, "rollout", d.message_id)

Many messages at once: ``await publish_protos(queue, SAMPLES_AGENT, [(key, sample), ...])`` and
``await queue.ack_many(stream, group, [d.message_id for d in handled])`` (one round trip each).
"""

from spade.queues.base import (
    ENVS_AUDITED,
    ENVS_READY,
    SAMPLES_AGENT,
    SAMPLES_DESIGNER,
    STREAMS,
    WEIGHTS_PUBLISHED,
    Delivery,
    QueueError,
    QueueFull,
    WorkQueue,
)
from spade.queues.config import (
    InProcessQueueConfig,
    QueueConfig,
    QueueConfigAdapter,
    RedisQueueConfig,
)
from spade.queues.factory import make_queue
from spade.queues.messages import decode, message_type, publish_proto, publish_protos

__all__ = [
    "ENVS_AUDITED",
    "ENVS_READY",
    "SAMPLES_AGENT",
    "SAMPLES_DESIGNER",
    "STREAMS",
    "WEIGHTS_PUBLISHED",
    "Delivery",
    "InProcessQueueConfig",
    "QueueConfig",
    "QueueConfigAdapter",
    "QueueError",
    "QueueFull",
    "RedisQueueConfig",
    "WorkQueue",
    "decode",
    "make_queue",
    "message_type",
    "publish_proto",
    "publish_protos",
]
