"""Designer samples as the learner takes them in (``services/learner/samples.py``)."""

from __future__ import annotations

import pytest

from services.learner.core.batching import BatchError
from services.learner.samples import designer_attempt
from spade.v1 import queues_pb2, types_pb2


def sample(
    output_ids: tuple[int, ...] = (4, 5),
    output_logprobs: tuple[float, ...] = (-0.5, -0.25),
    trainable: bool = True,
) -> queues_pb2.DesignerSample:
    return queues_pb2.DesignerSample(
        sample_id="d1",
        env_id="env-1",
        setting=types_pb2.SETTING_GAME,
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


def test_an_audit_verdict_carries_the_best_trivial_policys_win_rate() -> None:
    from services.learner.samples import env_audit

    message = queues_pb2.EnvAudit(
        env_id="e1",
        window_start=3,
        policies=[
            queues_pb2.AuditPolicyPlays(policy="noop", seeds=[1, 2], returns=[0.5, 0.5]),
            queues_pb2.AuditPolicyPlays(policy="random", seeds=[1, 2], returns=[0.0, 0.25]),
        ],
    )
    audit = env_audit(message)
    assert (audit.env_id, audit.trivially_won, audit.window_start, audit.trivial_win_rate) == ("e1", False, 3, 0.5)
    assert env_audit(queues_pb2.EnvAudit(env_id="e2")).trivial_win_rate == 0.0  # no plays: nothing to correct
    with pytest.raises(ValueError, match="outside"):
        env_audit(queues_pb2.EnvAudit(env_id="e3", policies=[queues_pb2.AuditPolicyPlays(returns=[1.5])]))
    with pytest.raises(ValueError, match="env_id"):
        env_audit(queues_pb2.EnvAudit())
