"""The queue factory (discriminated union) and the typed proto helpers."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from spade.queues import (
    ENVS_READY,
    SAMPLES_AGENT,
    STREAMS,
    Delivery,
    InProcessQueueConfig,
    QueueConfigAdapter,
    QueueError,
    RedisQueueConfig,
    decode,
    make_queue,
    publish_proto,
)
from spade.queues.inprocess import InProcessQueue
from spade.queues.redis_streams import RedisStreamQueue
from spade.retry import RetryPolicy
from spade.v1 import queues_pb2


def test_config_kind_selects_the_backend() -> None:
    assert isinstance(QueueConfigAdapter.validate_python({"kind": "redis"}), RedisQueueConfig)
    assert isinstance(QueueConfigAdapter.validate_python({"url": "redis://redis:6379/0"}), RedisQueueConfig)
    assert isinstance(make_queue(InProcessQueueConfig()), InProcessQueue)
    assert isinstance(make_queue(RedisQueueConfig()), RedisStreamQueue)


@pytest.mark.parametrize(
    "raw",
    [{"kind": "kafka"}, {"kind": "inprocess", "max_len": 0}, {"kind": "inprocess", "url": "redis://x"}],
)
def test_bad_queue_config_is_rejected(raw: dict) -> None:
    with pytest.raises(ValidationError):
        QueueConfigAdapter.validate_python(raw)


async def test_publish_proto_roundtrip_through_decode() -> None:
    q = InProcessQueue()
    msg = queues_pb2.AgentSample(sample_id="s", token_ids=[1, 2, 3], loss_mask=[False, True, True])
    await publish_proto(q, SAMPLES_AGENT, msg, key="s")
    [d] = await q.consume(SAMPLES_AGENT, "learner", "c", block_ms=10)
    assert decode(d) == msg
    assert all(name in STREAMS for name in ("envs.ready", "samples.designer", "weights.published"))


async def test_publish_proto_refuses_the_wrong_message_type() -> None:
    q = InProcessQueue()
    with pytest.raises(TypeError, match=r"carries spade\.v1\.EnvReady"):
        await publish_proto(q, ENVS_READY, queues_pb2.AgentSample(), key="k")
    with pytest.raises(KeyError, match="unknown stream"):
        await publish_proto(q, "nope", queues_pb2.AgentSample(), key="k")


def test_decode_reports_a_corrupt_payload() -> None:
    with pytest.raises(QueueError, match=r"not a valid spade\.v1\.EnvReady"):
        decode(Delivery(ENVS_READY, "1-0", "k", b"\xff\xff\xff", 1))


async def test_closed_inprocess_queue_refuses_work() -> None:
    q = InProcessQueue()
    await q.close()
    with pytest.raises(QueueError, match="closed"):
        await q.publish(ENVS_READY, b"x", key="k")


async def test_unreachable_redis_error_hides_the_password() -> None:
    q = RedisStreamQueue(
        RedisQueueConfig(url="redis://user:hunter2@127.0.0.1:1/0", retry=RetryPolicy(attempts=1, initial_s=0.01))
    )
    with pytest.raises(QueueError) as info:
        await q.publish(ENVS_READY, b"x", key="k")
    assert "hunter2" not in str(info.value) and "user:***@127.0.0.1:1" in str(info.value)
    await q.close()


async def test_redis_retries_are_redis_py_s_own_under_the_queue_s_policy() -> None:
    config = RedisQueueConfig(retry=RetryPolicy(attempts=5, initial_s=0.1, max_s=1.0))
    q = RedisStreamQueue(config)
    retry = q._redis.get_retry()
    assert retry is not None and retry.get_retries() == 4  # 5 tries in all, no loop of ours around it
    await q.close()
