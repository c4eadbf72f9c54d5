"""The designer's outbox over the work queues: domain results become protobuf messages.

A new valid environment goes to ``envs.ready`` as ``EnvReady`` (keyed by its env id), every
designer sample to ``samples.designer`` as ``DesignerSample`` (keyed by its sample id), so a
re-published result is stored once.
"""

from __future__ import annotations

from services.designer.core.ports import DesignerSample, EnvReady
from spade.envs.types import Setting
from spade.queues.base import ENVS_READY, SAMPLES_DESIGNER, WorkQueue
from spade.v1 import queues_pb2, sandbox_pb2
from spade.wire_enums import to_wire


def env_ready_message(ready: EnvReady) -> queues_pb2.EnvReady:
    """The ``envs.ready`` message announcing ``ready``."""
    return queues_pb2.EnvReady(
        env_id=ready.env_id,
        setting=to_wire(Setting.parse(ready.setting)),
        skill=ready.skill,
        weight_version=ready.weight_version,
        designer_sample_id=ready.designer_sample_id,
        spec_id=ready.spec_id,
    )


def designer_sample_message(sample: DesignerSample) -> queues_pb2.DesignerSample:
    """The ``samples.designer`` message carrying ``sample``."""
    return queues_pb2.DesignerSample(
        sample_id=sample.sample_id,
        env_id=sample.env_id,
        setting=to_wire(Setting.parse(sample.setting)),
        skill=sample.skill,
        prompt_ids=list(sample.prompt_ids),
        output_ids=list(sample.output_ids),
        output_logprobs=list(sample.output_logprobs),
        weight_version=sample.weight_version,
        valid=sample.valid,
        failed_check=sample.failed_check,
        checks=[sandbox_pb2.CheckResult(name=c.name, passed=c.passed, detail=c.detail) for c in sample.checks],
        batch_id=sample.batch_id,
        spec_id=sample.spec_id,
        trainable=sample.trainable,
        outcome=sample.outcome,
        constrained=sample.constrained,
    )


class QueueOutbox:
    """``Outbox`` over a ``WorkQueue`` (Redis Streams, or the in-process queue of the embedded run).

    Args:
        queue: The work queues.
    """

    def __init__(self, queue: WorkQueue) -> None:
        self._queue = queue

    async def publish_env_ready(self, ready: EnvReady, *, timeout_s: float) -> None:
        """Publish ``EnvReady`` on ``envs.ready``, keyed by the env id."""
        payload = env_ready_message(ready).SerializeToString()
        await self._queue.publish(ENVS_READY, payload, key=ready.env_id, timeout_s=timeout_s)

    async def publish_sample(self, sample: DesignerSample, *, timeout_s: float) -> None:
        """Publish the ``DesignerSample`` on ``samples.designer``, keyed by the sample id."""
        payload = designer_sample_message(sample).SerializeToString()
        await self._queue.publish(SAMPLES_DESIGNER, payload, key=sample.sample_id, timeout_s=timeout_s)
