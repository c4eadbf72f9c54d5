"""The outbox adapter: the core's results become the protobuf messages on the real in-process queue."""

from __future__ import annotations

from services.designer.core.ports import DesignerSample, EnvReady
from services.designer.outbox import QueueOutbox
from spade.envs.types import CheckResult
from spade.queues.base import ENVS_READY, SAMPLES_DESIGNER
from spade.queues.inprocess import InProcessQueue
from spade.v1 import queues_pb2, types_pb2

from .conftest import drain

SAMPLE = DesignerSample(
    sample_id="s-1",
    env_id="e-1",
    setting="tool",
    skill="Error Recovery",
    prompt_ids=(1, 2, 3),
    output_ids=(7, 8),
    output_logprobs=(-0.5, -0.25),
    weight_version=4,
    valid=False,
    failed_check="solution_replay",
    checks=(CheckResult("syntax", True, "parses"), CheckResult("solution_replay", False, "did not win seed 1")),
    batch_id="r4-b1",
    spec_id="spec-1",
    trainable=False,
    outcome="solution_replay",
    constrained=True,
)
READY = EnvReady(
    env_id="e-2", setting="game", skill="Optimization", weight_version=9, designer_sample_id="s-2", spec_id="spec-1"
)


async def test_every_field_reaches_the_wire_and_republishing_is_idempotent(queue: InProcessQueue) -> None:
    outbox = QueueOutbox(queue)
    for _ in range(2):  # a retried publish (same id) is stored once
        await outbox.publish_sample(SAMPLE, timeout_s=1.0)
        await outbox.publish_env_ready(READY, timeout_s=1.0)

    (sample_bytes,) = await drain(queue, SAMPLES_DESIGNER)
    sample = queues_pb2.DesignerSample.FromString(sample_bytes)
    assert (sample.sample_id, sample.env_id, sample.setting, sample.skill) == (
        "s-1",
        "e-1",
        types_pb2.SETTING_TOOL,
        "Error Recovery",
    )
    assert list(sample.prompt_ids) == [1, 2, 3] and list(sample.output_ids) == [7, 8]
    assert list(sample.output_logprobs) == [-0.5, -0.25]
    assert sample.weight_version == 4 and not sample.valid and sample.failed_check == "solution_replay"
    assert [(c.name, c.passed, c.detail) for c in sample.checks] == [
        ("syntax", True, "parses"),
        ("solution_replay", False, "did not win seed 1"),
    ]
    assert sample.batch_id == "r4-b1" and sample.spec_id == "spec-1"
    assert not sample.trainable and sample.outcome == "solution_replay" and sample.constrained

    (ready_bytes,) = await drain(queue, ENVS_READY)
    ready = queues_pb2.EnvReady.FromString(ready_bytes)
    assert (ready.env_id, ready.setting, ready.skill) == ("e-2", types_pb2.SETTING_GAME, "Optimization")
    assert ready.weight_version == 9 and ready.designer_sample_id == "s-2" and ready.spec_id == "spec-1"
