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

    An attempt is ready once the learner's version is at least its first version + ``k`` **and** its
    window is complete: ``group_size`` unhinted plays at every version of the window and as many
    hinted plays at the first version. Plays can lag behind the learner (queue latency, a restart
    waiting for re-deliveries), so an incomplete window waits up to ``grace`` more versions and is
    then scored with what arrived (or found unscorable). Invalid attempts need no plays. The
    attempts of one regeneration batch (``batch_id``) are due together, once all are ready, since
    their rewards are centred per skill within the batch.

    Args:
        k: Window length in weight versions (>= 1).
        config: The designer reward configuration.
        group_size: Plays per (env, version) group the rollout sends.
        grace: Extra versions an incomplete window may wait for late plays.
    """

    k: int
    config: DesignerRewardConfig = field(default_factory=DesignerRewardConfig)
    group_size: int = 1
    grace: int = 0
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
        ready = self._due_attempts(learner_version)
        out = [self._score(a) for a in ready]
        for a in ready:
            del self.pending[a.sample_id]
            if a.env_id and not any(p.env_id == a.env_id for p in self.pending.values()):
                self.plays.pop(a.env_id, None)
        return out

    def _ready(self, attempt: DesignerAttempt, learner_version: int) -> bool:
        closes = attempt.weight_version + self.k
        if learner_version < closes:
            return False
        if not attempt.scorable_env or learner_version >= closes + self.grace:
            return True
        return self.window_complete(attempt)

    def window_complete(self, attempt: DesignerAttempt) -> bool:
        """Whether every version of the attempt's window has its plays (see the class docstring)."""
        first = attempt.weight_version
        counts: dict[tuple[int, bool], int] = {}
        for p in self.plays.get(attempt.env_id, {}).values():
            counts[(p.weight_version, p.hinted)] = counts.get((p.weight_version, p.hinted), 0) + 1
        if counts.get((first, True), 0) < self.group_size:
            return False
        return all(counts.get((v, False), 0) >= self.group_size for v in range(first, first + self.k))

    def _due_attempts(self, learner_version: int) -> list[DesignerAttempt]:
        # A regeneration batch is scored as a unit (its rewards are centred per skill within it):
        # it is due when every pending attempt of the batch is.
        by_batch: dict[str, list[DesignerAttempt]] = {}
        for a in self.pending.values():
            by_batch.setdefault(a.batch_id or f"\x00{a.sample_id}", []).append(a)
        due = {
            id(a)
            for members in by_batch.values()
            if all(self._ready(m, learner_version) for m in members)
            for a in members
        }
        return [a for a in self.pending.values() if id(a) in due]

    def has_due(self, learner_version: int) -> bool:
        """Whether ``due`` would return anything now."""
        return bool(self._due_attempts(learner_version))

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
    def from_json(
        cls, data: dict[str, Any], config: DesignerRewardConfig, *, group_size: int = 1, grace: int = 0
    ) -> DesignerWindow:
        """Restore a snapshot written by ``to_json``; ``k`` comes from the snapshot."""
        window = cls(k=int(data["k"]), config=config, group_size=group_size, grace=grace)
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
