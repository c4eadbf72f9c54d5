"""The designer's delayed window: per-env play accumulators and pending designer attempts.

A designer attempt is scored only once its env has been played for ``k`` weight versions: regret
from the hinted/unhinted arms at the env's first version, the window win rate from every unhinted
play at versions ``first .. first+k-1``. Everything here is plain data, serialisable to JSON, so
the learner persists it with each checkpoint and a restart resumes with the same pending work.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any

from services.learner.core.rewards import (
    DesignerRewardComponents,
    DesignerRewardConfig,
    RewardError,
    designer_reward,
    regret,
)


@dataclass(frozen=True)
class Play:
    """One agent play as the window needs it."""

    sample_id: str
    env_id: str
    seed: int
    hinted: bool
    weight_version: int
    episode_return: float


@dataclass(frozen=True)
class DesignerAttempt:
    """One designer sample waiting for its reward.

    Attributes:
        weight_version: The env's first version (the designer's version when it wrote the env).
        validity_fraction: Fraction of validation checks passed (for optional shaping).
    """

    sample_id: str
    env_id: str
    setting: str
    skill: str
    batch_id: str
    weight_version: int
    valid: bool
    validity_fraction: float
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    output_logprobs: tuple[float, ...]

    @property
    def scorable_env(self) -> bool:
        """Whether the attempt stored an env that gets played (valid and with an id)."""
        return self.valid and bool(self.env_id)


class ScoreOutcome(enum.Enum):
    """How a due designer attempt was resolved."""

    SCORED = "scored"
    INVALID = "invalid"
    UNSCORABLE = "unscorable"


@dataclass(frozen=True)
class ScoredAttempt:
    """A designer attempt whose window closed.

    ``components`` is ``None`` exactly when ``outcome`` is ``UNSCORABLE`` (``reason`` says why:
    mismatched arms, no plays); such an attempt is not trained on and is counted in the metrics.
    """

    attempt: DesignerAttempt
    outcome: ScoreOutcome
    components: DesignerRewardComponents | None
    reason: str = ""


@dataclass
class DesignerWindow:
    """Accumulates plays per env and scores designer attempts when their window closes.

    Args:
        k: Window length in weight versions (>= 1).
        config: The designer reward configuration.
    """

    k: int
    config: DesignerRewardConfig = field(default_factory=DesignerRewardConfig)
    plays: dict[str, dict[str, Play]] = field(default_factory=dict)
    pending: dict[str, DesignerAttempt] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.k < 1:
            raise RewardError(f"the designer window k must be >= 1 weight version, got {self.k}")

    def record_play(self, play: Play) -> bool:
        """Add a play to its env's accumulator; ``False`` when this sample id was already recorded."""
        env = self.plays.setdefault(play.env_id, {})
        if play.sample_id in env:
            return False
        env[play.sample_id] = play
        return True

    def add_attempt(self, attempt: DesignerAttempt) -> bool:
        """Queue a designer attempt; ``False`` when it is already pending."""
        if attempt.sample_id in self.pending:
            return False
        self.pending[attempt.sample_id] = attempt
        return True

    def due(self, learner_version: int) -> list[ScoredAttempt]:
        """Score and remove every attempt with ``learner_version >= first version + k``.

        The accumulators of scored envs are released. Attempts come back in arrival order.
        """
        ready = [a for a in self.pending.values() if learner_version >= a.weight_version + self.k]
        out = [self._score(a) for a in ready]
        for a in ready:
            del self.pending[a.sample_id]
            if a.env_id and not any(p.env_id == a.env_id for p in self.pending.values()):
                self.plays.pop(a.env_id, None)
        return out

    def prune(self, learner_version: int, keep_versions: int) -> int:
        """Drop accumulators of envs no attempt waits for, last played more than ``keep_versions`` ago.

        Plays can arrive before their designer sample, so accumulators are kept for a while; this
        bounds memory for envs whose designer sample never comes. Returns how many envs were dropped.
        """
        waiting = {a.env_id for a in self.pending.values()}
        stale = [
            env_id
            for env_id, plays in self.plays.items()
            if env_id not in waiting
            and max((p.weight_version for p in plays.values()), default=-1) < learner_version - keep_versions
        ]
        for env_id in stale:
            del self.plays[env_id]
        return len(stale)

    def _score(self, attempt: DesignerAttempt) -> ScoredAttempt:
        if not attempt.scorable_env:
            components = designer_reward(None, None, False, self.config, attempt.validity_fraction)
            return ScoredAttempt(attempt, ScoreOutcome.INVALID, components)
        first = attempt.weight_version
        plays = list(self.plays.get(attempt.env_id, {}).values())
        hinted = [(p.seed, p.episode_return) for p in plays if p.hinted and p.weight_version == first]
        unhinted_first = [(p.seed, p.episode_return) for p in plays if not p.hinted and p.weight_version == first]
        window = [p.episode_return for p in plays if not p.hinted and first <= p.weight_version < first + self.k]
        if not window:
            return ScoredAttempt(
                attempt, ScoreOutcome.UNSCORABLE, None, f"no unhinted plays of env {attempt.env_id} in its window"
            )
        try:
            r = regret(hinted, unhinted_first)
            components = designer_reward(r, sum(window) / len(window), True, self.config)
        except RewardError as exc:
            return ScoredAttempt(attempt, ScoreOutcome.UNSCORABLE, None, f"env {attempt.env_id}: {exc}")
        return ScoredAttempt(attempt, ScoreOutcome.SCORED, components)

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable snapshot (``from_json`` restores it exactly)."""
        return {
            "k": self.k,
            "plays": {env: [asdict(p) for p in plays.values()] for env, plays in self.plays.items()},
            "pending": [asdict(a) for a in self.pending.values()],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any], config: DesignerRewardConfig) -> DesignerWindow:
        """Restore a snapshot written by ``to_json``; ``k`` comes from the snapshot."""
        window = cls(k=int(data["k"]), config=config)
        for env, plays in data["plays"].items():
            window.plays[env] = {p["sample_id"]: Play(**p) for p in plays}
        for a in data["pending"]:
            attempt = DesignerAttempt(
                **{
                    **a,
                    "prompt_ids": tuple(a["prompt_ids"]),
                    "output_ids": tuple(a["output_ids"]),
                    "output_logprobs": tuple(a["output_logprobs"]),
                }
            )
            window.pending[attempt.sample_id] = attempt
        return window
