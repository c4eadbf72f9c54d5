"""The designer's delayed window: per-env plays by window slot, and pending designer attempts.

An env's window is its own (WAVE2 §3): the rollout fixes it when it first plays the env
(``window_start``, ``k`` slots) and every play carries its slot (``window_index``). A designer attempt
is scored from its env's plays grouped by slot — never by the weight version that happened to
generate them, so a learner that published between the design and the first play loses nothing:

- regret: ``spade.signal.regret`` of slot 0's hinted and unhinted arms;
- window win rate: ``spade.signal.win_rate`` of every unhinted play of slots ``0..k-1``;
- blend: ``spade.signal.designer_blend`` (invalid attempts: 0, or the optional validity shaping).

A play that ended in a resource fault counts as return 0 (the env failed the agent), as in the
memory's statistics. Everything here is plain data, serialisable to JSON, so the learner persists it
with each checkpoint and a restart resumes with the same pending work.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from spade.envs.types import FinishReason
from spade.signal import (
    DesignerRewardComponents,
    DesignerRewardConfig,
    MismatchedArmsError,
    SignalError,
    designer_blend,
    regret,
    win_rate,
)


def is_resource_fault(finish_reason: str) -> bool:
    """Whether a play's finish reason is a resource fault (``FinishReason.is_resource_fault``).

    Unknown or empty reasons (older producers) are not.

    >>> is_resource_fault("fault_memory"), is_resource_fault("truncated"), is_resource_fault("")
    (True, False, False)
    """
    try:
        return FinishReason(finish_reason).is_resource_fault
    except ValueError:
        return False


@dataclass(frozen=True)
class Play:
    """One agent play as the window needs it.

    Attributes:
        weight_version: The version that generated it (staleness and pruning only; scoring uses
            the slot).
        window_start: The env's window start as the rollout fixed it.
        window_index: Which of the env's ``k`` slots the play belongs to (0: both arms, same seeds).
        finish_reason: A ``spade.envs.types.FinishReason`` value.
    """

    sample_id: str
    env_id: str
    seed: int
    hinted: bool
    weight_version: int
    episode_return: float
    window_start: int = 0
    window_index: int = 0
    finish_reason: str = FinishReason.TERMINATED.value

    @property
    def counted_return(self) -> float:
        """The return the window counts: 0 for a resource fault (the env failed the agent)."""
        return 0.0 if is_resource_fault(self.finish_reason) else self.episode_return


@dataclass(frozen=True)
class DesignerAttempt:
    """One designer sample waiting for its reward.

    Attributes:
        weight_version: The designer's version when it wrote the env (its samples' policy version).
        batch_id: The regeneration round (centring happens within (round, skill)).
        validity_fraction: Fraction of validation checks passed (for optional shaping).
        trainable: False for attempts that are scored but never trained on (pool or frozen designer).
        constrained: Generated under a grammar: its rollout logprobs are not the policy's own.
        outcome: The designer's name for the attempt's outcome (``valid``, ``malformed``, a check).
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
    trainable: bool = True
    constrained: bool = False
    outcome: str = ""

    @property
    def scorable_env(self) -> bool:
        """Whether the attempt stored an env that gets played (valid and with an id)."""
        return self.valid and bool(self.env_id)

    @property
    def round_key(self) -> str:
        """The round it is scored and centred with (an attempt without a round is a round of its own)."""
        return self.batch_id or f"\x00{self.sample_id}"


class ScoreOutcome(enum.Enum):
    """How a due designer attempt was resolved."""

    SCORED = "scored"
    INVALID = "invalid"
    UNSCORABLE = "unscorable"


class UnscoredReason(enum.Enum):
    """Why a valid env's attempt got no reward (counted per reason; never trained)."""

    NO_PLAYS = "no_plays"
    """No unhinted play of its window arrived in time."""
    MISSING_ARM = "missing_arm"
    """Slot 0 lacks the hinted or the unhinted arm."""
    MISMATCHED_ARMS = "mismatched_arms"
    """Slot 0's arms were not played on the same seeds the same number of times."""
    BAD_RETURNS = "bad_returns"
    """A return broke a rule of the signal (outside [0, 1], not finite)."""


@dataclass(frozen=True)
class ScoredAttempt:
    """A designer attempt whose window closed.

    ``components`` is ``None`` exactly when ``outcome`` is ``UNSCORABLE`` (``reason_code`` and
    ``reason`` say why); such an attempt is not trained on and is counted in the metrics.
    """

    attempt: DesignerAttempt
    outcome: ScoreOutcome
    components: DesignerRewardComponents | None
    reason: str = ""
    reason_code: UnscoredReason | None = None


@dataclass
class DesignerWindow:
    """Accumulates plays per env and slot, and scores designer attempts when their window is done.

    An attempt is ready when its window is **complete** — ``group_size`` unhinted plays in every slot
    ``0..k-1`` and as many hinted plays in slot 0 — or, when plays lag (queue latency, a restart,
    a slot the rollout could not play in time), once the learner's version reaches the window's end
    (``window_start + k``) plus ``grace``; it is then scored with what arrived. An env never played
    at all waits until ``design version + k + grace + first_play_grace`` and is then unscorable.
    Invalid attempts need no plays. The attempts of one round (``batch_id``) are due together, since
    their advantages are centred per skill within the round.

    Args:
        windows: ``k`` per setting (``{"game": 4, "tool": 8}``: the run spec's).
        config: The designer reward configuration (the run spec's constants).
        group_size: G, the plays per slot and arm.
        grace: Versions past the window's end an incomplete window waits for late plays.
        first_play_grace: Further versions an env waits for its first play.
    """

    windows: Mapping[str, int]
    config: DesignerRewardConfig = field(default_factory=DesignerRewardConfig)
    group_size: int = 1
    grace: int = 0
    first_play_grace: int = 0
    plays: dict[str, dict[str, Play]] = field(default_factory=dict)
    pending: dict[str, DesignerAttempt] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for setting, k in self.windows.items():
            if k < 1:
                raise SignalError(f"the window of {setting} envs must be >= 1 slot, got k={k}")

    def k_for(self, setting: str) -> int:
        """The window length of ``setting``'s envs.

        Raises:
            SignalError: A setting the run spec does not know.
        """
        try:
            return self.windows[setting]
        except KeyError:
            raise SignalError(
                f"unknown setting {setting!r}: the run spec has windows for {sorted(self.windows)}"
            ) from None

    def record_play(self, play: Play) -> bool:
        """Add a play to its env's accumulator; ``False`` when this sample id was already recorded."""
        env = self.plays.setdefault(play.env_id, {})
        if play.sample_id in env:
            return False
        env[play.sample_id] = play
        return True

    def add_attempt(self, attempt: DesignerAttempt) -> bool:
        """Queue a designer attempt; ``False`` when it is already pending."""
        self.k_for(attempt.setting)
        if attempt.sample_id in self.pending:
            return False
        self.pending[attempt.sample_id] = attempt
        return True

    def window_start(self, env_id: str) -> int | None:
        """The env's window start as its plays carry it (``None`` before its first play)."""
        plays = self.plays.get(env_id)
        return min(p.window_start for p in plays.values()) if plays else None

    def slot_counts(self, env_id: str) -> dict[tuple[int, bool], int]:
        """Plays received per (window slot, hinted)."""
        counts: dict[tuple[int, bool], int] = {}
        for p in self.plays.get(env_id, {}).values():
            counts[(p.window_index, p.hinted)] = counts.get((p.window_index, p.hinted), 0) + 1
        return counts

    def window_complete(self, attempt: DesignerAttempt) -> bool:
        """Whether every slot of the attempt's window has its plays (see the class docstring)."""
        counts = self.slot_counts(attempt.env_id)
        if counts.get((0, True), 0) < self.group_size:
            return False
        return all(counts.get((i, False), 0) >= self.group_size for i in range(self.k_for(attempt.setting)))

    def deadline(self, attempt: DesignerAttempt) -> int:
        """The learner version at which the attempt is scored with whatever arrived."""
        k = self.k_for(attempt.setting)
        start = self.window_start(attempt.env_id)
        if start is None:
            return attempt.weight_version + k + self.grace + self.first_play_grace
        return start + k + self.grace

    def _ready(self, attempt: DesignerAttempt, learner_version: int) -> bool:
        if not attempt.scorable_env:
            return True
        return self.window_complete(attempt) or learner_version >= self.deadline(attempt)

    def _due_attempts(self, learner_version: int) -> list[DesignerAttempt]:
        by_round: dict[str, list[DesignerAttempt]] = {}
        for a in self.pending.values():
            by_round.setdefault(a.round_key, []).append(a)
        due = {
            a.sample_id
            for members in by_round.values()
            if all(self._ready(m, learner_version) for m in members)
            for a in members
        }
        return [a for a in self.pending.values() if a.sample_id in due]

    def has_due(self, learner_version: int) -> bool:
        """Whether ``due`` would return anything now."""
        return bool(self._due_attempts(learner_version))

    def due(self, learner_version: int) -> list[ScoredAttempt]:
        """Score and remove every attempt whose whole round is ready (arrival order).

        The accumulators of scored envs are released.
        """
        ready = self._due_attempts(learner_version)
        out = [self._score(a) for a in ready]
        for a in ready:
            del self.pending[a.sample_id]
            if a.env_id and not any(p.env_id == a.env_id for p in self.pending.values()):
                self.plays.pop(a.env_id, None)
        return out

    def prune(self, learner_version: int, keep_versions: int) -> int:
        """Drop accumulators of envs no attempt waits for, last played more than ``keep_versions`` ago.

        Plays can arrive before their designer sample, so accumulators are kept for a while; this
        bounds memory for envs whose designer sample never comes (the seed pool's). Returns how many
        envs were dropped.
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
            components = designer_blend(None, None, False, self.config, attempt.validity_fraction)
            return ScoredAttempt(attempt, ScoreOutcome.INVALID, components)
        k = self.k_for(attempt.setting)
        plays = list(self.plays.get(attempt.env_id, {}).values())
        window = [p.counted_return for p in plays if not p.hinted and 0 <= p.window_index < k]
        hinted = [(p.seed, p.counted_return) for p in plays if p.hinted and p.window_index == 0]
        unhinted = [(p.seed, p.counted_return) for p in plays if not p.hinted and p.window_index == 0]

        def unscored(code: UnscoredReason, why: str) -> ScoredAttempt:
            return ScoredAttempt(attempt, ScoreOutcome.UNSCORABLE, None, f"env {attempt.env_id}: {why}", code)

        if not window:
            return unscored(UnscoredReason.NO_PLAYS, f"no unhinted play of its {k} window slots arrived in time")
        if not hinted or not unhinted:
            return unscored(
                UnscoredReason.MISSING_ARM,
                f"slot 0 has {len(hinted)} hinted and {len(unhinted)} unhinted plays; regret needs both arms",
            )
        try:
            r = regret(hinted, unhinted)
            components = designer_blend(r, win_rate(window), True, self.config)
        except MismatchedArmsError as exc:
            return unscored(UnscoredReason.MISMATCHED_ARMS, str(exc))
        except SignalError as exc:
            return unscored(UnscoredReason.BAD_RETURNS, str(exc))
        return ScoredAttempt(attempt, ScoreOutcome.SCORED, components)

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable snapshot (``from_json`` restores it exactly)."""
        return {
            "plays": {env: [asdict(p) for p in plays.values()] for env, plays in self.plays.items()},
            "pending": [asdict(a) for a in self.pending.values()],
        }

    @classmethod
    def from_json(
        cls,
        data: dict[str, Any],
        windows: Mapping[str, int],
        config: DesignerRewardConfig,
        *,
        group_size: int = 1,
        grace: int = 0,
        first_play_grace: int = 0,
    ) -> DesignerWindow:
        """Restore a snapshot written by ``to_json`` (the windows and constants come from the run spec)."""
        window = cls(windows, config, group_size, grace, first_play_grace)
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
