"""Designer samples as the learner takes them in (``services/learner/samples.py``)."""

from __future__ import annotations

import pytest

from services.learner.core.batching import BatchError
from services.learner.samples import designer_attempt
from spade.v1 import queues_pb2


def sample(
    output_ids: tuple[int, ...] = (4, 5),
    output_logprobs: tuple[float, ...] = (-0.5, -0.25),
    trainable: bool = True,
) -> queues_pb2.DesignerSample:
    return queues_pb2.DesignerSample(
        sample_id="d1",
        env_id="env-1",
        setting="game",
        skill="search",
        batch_id="round-1",
        valid=True,
        prompt_ids=[1, 2, 3],
        output_ids=output_ids,
        output_logprobs=output_logprobs,
        trainable=trainable,
    )


def test_a_trainable_sample_without_output_tokens_is_refused_at_intake() -> None:
    # Taken in, it would raise when its round is scored: every step, and again after each replay.
    with pytest.raises(BatchError, match="trainable but has no output tokens"):
        designer_attempt(sample(output_ids=(), output_logprobs=()))


def test_an_untrainable_sample_without_output_tokens_is_kept_for_its_round() -> None:
    attempt = designer_attempt(sample(output_ids=(), output_logprobs=(), trainable=False))
    assert attempt.output_ids == () and not attempt.trainable and attempt.valid


def test_output_ids_and_logprobs_must_pair_up() -> None:
    with pytest.raises(BatchError, match="2 output ids but 1 logprobs"):
        designer_attempt(sample(output_logprobs=(-0.5,)))
