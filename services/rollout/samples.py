"""Plays to wire messages: ``AgentSample`` for the learner, ``PlayRecord`` for the memory.

Sample ids are deterministic (env, version, arm, seed), so a play that is re-run after a crash or a
re-delivery publishes under the same idempotency key and is stored once.

>>> sample_id("env-1", 3, 77, hinted=True)
'env-1@v3/hint/77'
>>> group_id("env-1", 3)
'env-1@v3'
"""

from __future__ import annotations

from services.rollout.core.episode import Play
from services.rollout.core.ports import EnvSpec, PlayRecord
from spade.v1 import queues_pb2


def group_id(env_id: str, version: int) -> str:
    """The GRPO group of an env at a weight version (env × version)."""
    return f"{env_id}@v{version}"


def sample_id(env_id: str, version: int, seed: int, *, hinted: bool) -> str:
    """The id of one play: also its idempotency key on ``samples.agent`` and in the memory."""
    return f"{group_id(env_id, version)}/{'hint' if hinted else 'plain'}/{seed}"


def play_version(play: Play, scheduled: int) -> int:
    """The weight version a play is attributed to: the oldest of its model turns (or the scheduled one)."""
    oldest = play.trajectory.oldest_version
    return scheduled if oldest is None else oldest


def to_agent_sample(play: Play, env: EnvSpec, scheduled: int) -> queues_pb2.AgentSample:
    """The learner's view of a play scheduled at weight version ``scheduled``."""
    t = play.trajectory
    return queues_pb2.AgentSample(
        sample_id=sample_id(env.env_id, scheduled, play.seed, hinted=play.hinted),
        env_id=env.env_id,
        setting=env.setting,
        skill=env.skill,
        seed=play.seed,
        hinted=play.hinted,
        group_id=group_id(env.env_id, scheduled),
        token_ids=t.token_ids,
        logprobs=t.logprobs,
        loss_mask=t.loss_mask,
        episode_return=play.episode_return,
        turns=play.turns,
        weight_version=play_version(play, scheduled),
        finish_reason=play.finish_reason.value,
    )


def to_play_record(play: Play, scheduled: int) -> PlayRecord:
    """The memory's view of a play, labelled with its window version.

    The memory measures regret on the plays labelled with the env's first version and the windowed
    win rate on those labelled inside the window, so plays carry the version they were scheduled
    for; the learner's ``AgentSample`` carries the weights that actually produced the tokens.
    """
    return PlayRecord(
        sample_id=sample_id(play.env_id, scheduled, play.seed, hinted=play.hinted),
        env_id=play.env_id,
        seed=play.seed,
        hinted=play.hinted,
        episode_return=play.episode_return,
        turns=play.turns,
        weight_version=scheduled,
        finish_reason=play.finish_reason.value,
    )
