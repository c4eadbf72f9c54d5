"""Adapters from the wire (``queues_pb2`` messages) to the learner's domain objects, and back to JSON.

Nothing here decides anything: it checks shapes, names what is wrong, and copies fields.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from services.learner.core.batching import AgentPlaySample, BatchError, Role, TrainSample
from services.learner.core.window import Audit, DesignerAttempt, Play
from spade.envs.types import FinishReason, Setting
from spade.signal import validity_fraction, win_rate
from spade.v1 import queues_pb2
from spade.wire_enums import from_wire


def group_key(sample: queues_pb2.AgentSample) -> str:
    """The advantage group of a play: its ``group_id`` (one env, one window slot), per arm."""
    group = sample.group_id or f"{sample.env_id}@{sample.weight_version}"
    return f"{group}|{'hinted' if sample.hinted else 'plain'}"


def finish_reason(sample: queues_pb2.AgentSample) -> FinishReason:
    """How the play ended.

    Raises:
        BatchError: The sample names no finish reason, or one this learner does not know.
    """
    try:
        return from_wire(FinishReason, sample.finish_reason)
    except ValueError as exc:
        raise BatchError(f"agent sample {sample.sample_id}: {exc}") from None


def agent_play(sample: queues_pb2.AgentSample) -> Play:
    """What the designer window needs from a play."""
    return Play(
        sample_id=sample.sample_id,
        env_id=sample.env_id,
        seed=int(sample.seed),
        hinted=bool(sample.hinted),
        weight_version=int(sample.weight_version),
        episode_return=float(sample.episode_return),
        window_start=int(sample.window_start),
        window_index=int(sample.window_index),
        finish_reason=finish_reason(sample),
    )


def agent_train_sample(sample: queues_pb2.AgentSample) -> AgentPlaySample:
    """The trainable sequence of a play (advantage assigned later, within its group).

    Raises:
        BatchError: Token ids, logprobs and mask do not line up.
    """
    if not sample.sample_id:
        raise BatchError("agent sample without sample_id: the rollout must name every sample")
    train = TrainSample(
        sample_id=sample.sample_id,
        role=Role.AGENT,
        token_ids=tuple(sample.token_ids),
        rollout_logprobs=tuple(float(x) for x in sample.logprobs),
        loss_mask=tuple(bool(x) for x in sample.loss_mask),
        weight_version=int(sample.weight_version),
    )
    return AgentPlaySample(train, group_key(sample), float(sample.episode_return), finish_reason(sample))


def _setting(sample: queues_pb2.DesignerSample) -> Setting:
    try:
        return from_wire(Setting, sample.setting)
    except ValueError as exc:
        raise BatchError(f"designer sample {sample.sample_id}: {exc}") from None


def designer_attempt(sample: queues_pb2.DesignerSample) -> DesignerAttempt:
    """A designer sample as the window keeps it.

    Raises:
        BatchError: No sample id, output ids and logprobs of different lengths, or a sample marked
            trainable without output tokens (refused here: taken in, it would fail its whole round's
            scoring at every step, and again after every journal replay).
    """
    if not sample.sample_id:
        raise BatchError("designer sample without sample_id: the designer must name every sample")
    if sample.trainable and not sample.output_ids:
        raise BatchError(f"designer sample {sample.sample_id} is marked trainable but has no output tokens")
    if len(sample.output_ids) != len(sample.output_logprobs):
        raise BatchError(
            f"designer sample {sample.sample_id}: {len(sample.output_ids)} output ids but "
            f"{len(sample.output_logprobs)} logprobs; send one logprob per output token"
        )
    return DesignerAttempt(
        sample_id=sample.sample_id,
        env_id=sample.env_id,
        setting=_setting(sample),
        skill=sample.skill,
        batch_id=sample.batch_id,
        weight_version=int(sample.weight_version),
        valid=bool(sample.valid) and bool(sample.env_id),
        validity_fraction=validity_fraction(c.passed for c in sample.checks),
        prompt_ids=tuple(sample.prompt_ids),
        output_ids=tuple(sample.output_ids),
        output_logprobs=tuple(float(x) for x in sample.output_logprobs),
        trainable=bool(sample.trainable),
        constrained=bool(sample.constrained),
        outcome=sample.outcome,
    )


def env_audit(message: queues_pb2.EnvAudit) -> Audit:
    """The rollout's audit verdict as the window keeps it, with the best trivial policy's win rate.

    Raises:
        ValueError: No env id, or a trivial policy's return outside [0, 1] (``spade.signal.SignalError``).
    """
    if not message.env_id:
        raise ValueError("an audit verdict without env_id: the rollout names the env it audited")
    rates = [win_rate(p.returns) for p in message.policies if p.returns]
    return Audit(
        message.env_id, bool(message.trivially_won), message.reason, int(message.window_start), max(rates, default=0.0)
    )


def play_sample_to_json(p: AgentPlaySample) -> dict[str, Any]:
    """JSON form of a buffered play (for the learner state file)."""
    s = asdict(p.sample)
    s["role"] = p.sample.role.value
    return {
        "sample": s,
        "group_key": p.group_key,
        "episode_return": p.episode_return,
        "finish_reason": p.finish_reason,
    }


def play_sample_from_json(data: dict[str, Any]) -> AgentPlaySample:
    """Inverse of ``play_sample_to_json``."""
    s = dict(data["sample"])
    train = TrainSample(
        sample_id=s["sample_id"],
        role=Role(s["role"]),
        token_ids=tuple(s["token_ids"]),
        rollout_logprobs=tuple(s["rollout_logprobs"]),
        loss_mask=tuple(s["loss_mask"]),
        weight_version=int(s["weight_version"]),
        advantage=float(s["advantage"]),
        constrained=bool(s.get("constrained", False)),
    )
    reason = FinishReason(data["finish_reason"])
    return AgentPlaySample(train, data["group_key"], float(data["episode_return"]), reason)
