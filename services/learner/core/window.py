"""The designer's delayed window: per-env plays by window slot, and pending designer attempts.

An env's window is its own (WAVE2 §3): the rollout fixes it when it first plays the env
(``window_start``, ``k`` slots) and every play carries its slot (``window_index``). A designer attempt
is scored from its env's plays grouped by slot — never by the weight version that happened to
generate them, so a learner that published between the design and the first play loses nothing:

- regret: ``spade.signal.regret`` of slot 0's hinted and unhinted arms;
- window win rate: ``spade.signal.win_rate`` of every unhinted play of slots ``0..k-1``;
- blend: ``spade.signal.designer_blend`` (invalid attempts: 0, or the optional validity shaping).

When the run audits its envs (the run spec's ``audit_plays``), an attempt also waits for its env's
audit verdict (``envs.audited``): a trivial policy that won the env too often on real rollout seeds
makes the attempt invalid, whatever its validation said, before anything is trained on it.

Which plays count, and with what return (a resource fault counts 0: the env failed the agent), is
``spade.signal``'s selection (``slot0_arms``, ``window_returns``), as in the memory's statistics.
Everything here is plain data, serialisable to JSON, so the learner persists it with each checkpoint
and a restart resumes with the same pending work.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
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
    slot0_arms,
    win_rate,
    window_returns,
)


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
    finish_reason: FinishReason = FinishReason.TERMINATED


@dataclass(frozen=True)
class Audit:
    """The rollout's audit verdict on one env (``services/rollout/core/audit.py``).

    Attributes:
        trivially_won: A trivial policy won it too often: the env is retired, its attempt invalid.
        reason: The rollout's sentence (policy, wins, threshold); "" when it passed.
        window_start: The env's window start (pruning only).
        trivial_win_rate: The best trivial policy's win rate: the plateau is taken of the agent's win
            rate above it (``spade.signal.chance_corrected``).
    """

    env_id: str
    trivially_won: bool
    reason: str = ""
    window_start: int = 0
    trivial_win_rate: float = 0.0


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
    NO_AUDIT = "no_audit"
    """The run audits its envs and this env's audit verdict never arrived."""


@dataclass(frozen=True)
class ScoredAttempt:
    """A designer attempt whose window closed.

    ``components`` is ``None`` exactly when ``outcome`` is ``UNSCORABLE`` (``reason_code`` and
    ``reason`` say why); such an attempt is not trained on and is counted in the metrics.
    ``trivially_won``: the attempt passed validation but its env's audit retired it, so it is scored
    ``INVALID`` (``reason`` has the audit's sentence).
    """

    attempt: DesignerAttempt
    outcome: ScoreOutcome
    components: DesignerRewardComponents | None
    reason: str = ""
    reason_code: UnscoredReason | None = None
    trivially_won: bool = False


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

    With ``await_audit`` (the run audits its envs), a valid env's attempt is never scored before its
    audit verdict: a ``trivially_won`` verdict makes it due at once and scores it invalid, at the
    lowest reward an invalid attempt can get (validity fraction 0: it gamed validation); without a
    verdict by the deadline it is unscorable (``no_audit``), never scored on unaudited plays.

    Args:
        windows: ``k`` per setting (``{"game": 4, "tool": 8}``: the run spec's).
        config: The designer reward configuration (the run spec's constants).
        group_size: G, the plays per slot and arm.
        grace: Versions past the window's end an incomplete window waits for late plays.
        first_play_grace: Further versions an env waits for its first play.
        await_audit: Wait for each env's audit verdict before scoring its attempt.
    """

    windows: Mapping[str, int]
    config: DesignerRewardConfig = field(default_factory=DesignerRewardConfig)
    group_size: int = 1
    grace: int = 0
    first_play_grace: int = 0
    await_audit: bool = False
    plays: dict[str, dict[str, Play]] = field(default_factory=dict)
    pending: dict[str, DesignerAttempt] = field(default_factory=dict)
    audits: dict[str, Audit] = field(default_factory=dict)

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

    def record_audit(self, audit: Audit) -> bool:
        """Keep an env's audit verdict; ``False`` when it already has one (the first wins, as in the rollout)."""
        if audit.env_id in self.audits:
            return False
        self.audits[audit.env_id] = audit
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
        audit = self.audits.get(attempt.env_id)
        if audit is not None and audit.trivially_won:
            return True
        if self.await_audit and audit is None:
            return learner_version >= self.deadline(attempt)
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

    def score_due(self, learner_version: int) -> list[ScoredAttempt]:
        """Score every attempt whose whole round is ready (arrival order), removing nothing (``release`` does)."""
        return [self._score(a) for a in self._due_attempts(learner_version)]

    def release(self, scored: Iterable[ScoredAttempt]) -> None:
        """Remove scored attempts; the accumulators of envs no attempt waits for any more are released."""
        for s in scored:
            a = s.attempt
            del self.pending[a.sample_id]
            if a.env_id and not any(p.env_id == a.env_id for p in self.pending.values()):
                self.plays.pop(a.env_id, None)
                self.audits.pop(a.env_id, None)

    def due(self, learner_version: int) -> list[ScoredAttempt]:
        """Score and remove every attempt whose whole round is ready (arrival order).

        The accumulators of scored envs are released.
        """
        out = self.score_due(learner_version)
        self.release(out)
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
        old_audits = [
            env_id
            for env_id, audit in self.audits.items()
            if env_id not in waiting
            and env_id not in self.plays
            and audit.window_start < learner_version - keep_versions
        ]
        for env_id in old_audits:
            del self.audits[env_id]
        return len(stale)

    def _score(self, attempt: DesignerAttempt) -> ScoredAttempt:
        if not attempt.scorable_env:
            components = designer_blend(None, None, False, self.config, attempt.validity_fraction)
            return ScoredAttempt(attempt, ScoreOutcome.INVALID, components)
        audit = self.audits.get(attempt.env_id)
        if audit is not None and audit.trivially_won:
            components = designer_blend(None, None, False, self.config, 0.0)
            why = f"env {attempt.env_id} retired as trivially_won by its audit plays: {audit.reason}"
            return ScoredAttempt(attempt, ScoreOutcome.INVALID, components, why, trivially_won=True)

        def unscored(code: UnscoredReason, why: str) -> ScoredAttempt:
            return ScoredAttempt(attempt, ScoreOutcome.UNSCORABLE, None, f"env {attempt.env_id}: {why}", code)

        if self.await_audit and audit is None:
            return unscored(UnscoredReason.NO_AUDIT, "the run audits its envs and no audit verdict arrived in time")
        k = self.k_for(attempt.setting)
        plays = list(self.plays.get(attempt.env_id, {}).values())
        window = window_returns(plays, k)
        hinted, unhinted = slot0_arms(plays)

        if not window:
            return unscored(UnscoredReason.NO_PLAYS, f"no unhinted play of its {k} window slots arrived in time")
        if not hinted or not unhinted:
            return unscored(
                UnscoredReason.MISSING_ARM,
                f"slot 0 has {len(hinted)} hinted and {len(unhinted)} unhinted plays; regret needs both arms",
            )
        try:
            r = regret(hinted, unhinted)
            trivial = audit.trivial_win_rate if audit is not None else 0.0
            components = designer_blend(r, win_rate(window), True, self.config, trivial_win_rate=trivial)
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
            "audits": [asdict(a) for a in self.audits.values()],
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
        await_audit: bool = False,
    ) -> DesignerWindow:
        """Restore a snapshot written by ``to_json`` (the windows and constants come from the run spec)."""
        window = cls(windows, config, group_size, grace, first_play_grace, await_audit)
        for a in data.get("audits", []):  # absent in snapshots written before audits
            window.audits[a["env_id"]] = Audit(**a)
        for env, plays in data["plays"].items():
            window.plays[env] = {
                p["sample_id"]: Play(**{**p, "finish_reason": FinishReason(p.get("finish_reason", "terminated"))})
                for p in plays
            }
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
