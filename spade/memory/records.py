"""Plain records the memory stores and returns; no database or wire types here."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from spade.envs.types import FinishReason, Setting


class EnvStatus(enum.StrEnum):
    """Where an environment is in its life.

    ``VALID`` passed every validation check and is in the pool; ``INVALID`` failed one (kept with its
    report for inspection and the designer's reward); ``RETIRED`` was valid and its window closed;
    ``TRIVIALLY_WON`` passed validation but a trivial policy (a constant or random action) won it too
    often in the rollout's audit plays on real seeds: none of its real plays kept, out of the pool,
    its designer sample scored invalid.
    """

    VALID = "valid"
    INVALID = "invalid"
    RETIRED = "retired"
    TRIVIALLY_WON = "trivially_won"


@dataclass(frozen=True)
class NewEnvironment:
    """An environment to store.

    Attributes:
        setting: The kind of environment (game or tool).
        skill: The skill it was designed for.
        code: The environment code (after the known repairs).
        hint: The privileged hint written with it.
        validation_report: The sandbox's report as a JSON object (``valid``, ``checks`` ...).
        status: ``valid`` or ``invalid`` (from the report); ``retired`` comes later.
        weight_version: Policy version that designed it (its window starts here).
        designer_sample_id: The designer sample that produced it.
        env_class: Name of the environment class, when known.
        corpus_ref: Reference to the corpus document it was grounded in (id, path or URL).
        batch_id: The regeneration batch.
        parent_ids: Ids of environments it was derived from (lineage).
    """

    setting: Setting
    skill: str
    code: str
    hint: str = ""
    validation_report: dict[str, Any] = field(default_factory=dict)
    status: EnvStatus = EnvStatus.VALID
    weight_version: int = 0
    designer_sample_id: str = ""
    env_class: str = ""
    corpus_ref: str = ""
    batch_id: str = ""
    parent_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class EnvStats:
    """Per-environment statistics.

    Every figure is defined in ``spade.signal`` (DESIGN §5); the memory only groups the plays.

    Attributes:
        plays: Every recorded play (both arms, every slot).
        window_plays: Unhinted plays in the env's window slots ``0..k-1``.
        win_rate: ``spade.signal.win_rate`` (mean return) of those plays, a resource fault counting
            as return 0; ``None`` until one such play exists (not yet scored).
        regret: ``spade.signal.regret`` of slot 0's two arms; ``None`` until both arms are complete
            and played on the same seeds the same number of times (``regret_note`` says why not).
        learnable: ``spade.signal.learnable(win_rate)`` (or as set by the learner).
        reward_components: The learner's designer-reward terms (regret_norm, plateau, blend ...).
        solved_fraction: Share of the window plays that reached return 1 (display only).
        regret_note: Why no regret is stored ("" when one is, or before any slot-0 play).
    """

    plays: int = 0
    window_plays: int = 0
    win_rate: float | None = None
    regret: float | None = None
    learnable: bool = False
    reward_components: dict[str, float] = field(default_factory=dict)
    solved_fraction: float | None = None
    regret_note: str = ""


@dataclass(frozen=True)
class Environment:
    """A stored environment with its statistics.

    ``window_start`` and ``window_versions`` are the env's own window (WAVE2 §3), fixed by the first
    ``set_window`` (the rollout, when it first plays the env): ``None`` and 0 before that.
    """

    id: str
    seq: int
    setting: Setting
    skill: str
    code: str
    code_hash: str
    hint: str
    validation_report: dict[str, Any]
    status: EnvStatus
    weight_version: int
    designer_sample_id: str
    env_class: str
    corpus_ref: str
    batch_id: str
    parent_ids: tuple[str, ...]
    created_at: datetime
    stats: EnvStats = field(default_factory=EnvStats)
    window_start: int | None = None
    window_versions: int = 0


@dataclass(frozen=True)
class PutResult:
    """Outcome of storing an environment.

    Attributes:
        env_id: The new environment's id, or the existing one's when this is a duplicate.
        duplicate_of: Id of the stored environment with the same normalised code, else ``None``
            (nothing new was stored then).
    """

    env_id: str
    duplicate_of: str | None = None

    @property
    def duplicate(self) -> bool:
        """True when nothing new was stored."""
        return self.duplicate_of is not None


@dataclass(frozen=True)
class Play:
    """One episode of the agent on an environment.

    Attributes:
        env_id: The environment played.
        seed: The reset seed.
        hinted: Whether the hint was shown.
        episode_return: The episode's return (terminal reward; 0 when truncated).
        turns: Turns taken.
        weight_version: Policy version that played.
        trajectory_id: Unique id of the trajectory (the agent sample id); a play recorded twice under
            the same id is stored once, so re-delivered work cannot double-count.
        finish_reason: How the episode ended (``terminated``, ``truncated``, ``turn_limit``,
            ``fault_memory`` ...; None when the producer did not say). A resource fault counts as
            return 0 in the env's statistics (the env failed the agent).
        played_at: When it was played (the store's clock when omitted).
        window_start: The env's window start (its stored window; informational).
        window_index: Which of the env's ``k`` window slots the play belongs to (0..k-1); slot 0
            holds both arms on the same seeds. Statistics group plays by slot, never by
            ``weight_version``.
        spec_id: The run spec the play was made under.
    """

    env_id: str
    seed: int
    hinted: bool
    episode_return: float
    turns: int
    weight_version: int
    trajectory_id: str
    finish_reason: FinishReason | None = None
    played_at: datetime | None = None
    window_start: int = 0
    window_index: int = 0
    spec_id: str = ""


@dataclass(frozen=True)
class RecordResult:
    """Outcome of recording plays or attempts: how many were new, how many were already recorded."""

    recorded: int
    duplicates: int


@dataclass(frozen=True)
class StatsUpdate:
    """What the learner (or an operator) sets on an environment's statistics.

    Attributes:
        reward_components: Merged into the stored components (same keys overwrite).
        learnable: Overrides the learnable flag when not ``None``.
        status: Moves the environment to this status when not ``None`` (e.g. ``retired``).
    """

    reward_components: dict[str, float] = field(default_factory=dict)
    learnable: bool | None = None
    status: EnvStatus | None = None


@dataclass(frozen=True)
class EnvFilter:
    """Filters of an environment listing; ``None`` means no filter."""

    setting: Setting | None = None
    skill: str | None = None
    status: EnvStatus | None = None
    min_regret: float | None = None
    max_win_rate: float | None = None
    q: str | None = None


@dataclass(frozen=True)
class Page:
    """One page of a listing, newest first.

    Attributes:
        items: The environments of this page.
        next_cursor: Pass back to get the next page; ``None`` on the last page. Cursors are keyset
            positions, so environments stored meanwhile never shift or repeat later pages.
    """

    items: tuple[Environment, ...]
    next_cursor: str | None


@dataclass(frozen=True)
class Candidate:
    """A scored environment as the memory policy sees it (no code: it is fetched for the chosen few).

    Attributes:
        env_id: Its id.
        seq: Its insertion order (higher is newer).
        skill: Its skill.
        win_rate: Windowed win rate (``None``: not scored, ignored by the policy).
        regret: Regret, when measured.
        window_plays: Unhinted plays behind the win rate.
    """

    env_id: str
    seq: int
    skill: str
    win_rate: float | None
    regret: float | None
    window_plays: int = 0


@dataclass(frozen=True)
class Pick:
    """A candidate the policy chose, and why."""

    candidate: Candidate
    reason: str


@dataclass(frozen=True)
class Picks:
    """The policy's choice before code excerpts are attached."""

    positives: tuple[Pick, ...] = ()
    negatives: tuple[Pick, ...] = ()

    def env_ids(self) -> list[str]:
        """Ids of every chosen environment."""
        return [p.candidate.env_id for p in (*self.positives, *self.negatives)]


@dataclass(frozen=True)
class Example:
    """One earlier environment shown to the designer.

    Attributes:
        env_id: Its id.
        skill: Its skill.
        code: A short excerpt of its code.
        reason: Why it is shown, with its numbers (``"learnable: win rate 0.45, regret 0.30"``).
        win_rate: Windowed win rate.
        regret: Regret, when measured.
    """

    env_id: str
    skill: str
    code: str
    reason: str
    win_rate: float
    regret: float | None


@dataclass(frozen=True)
class Examples:
    """Positives (imitate the quality) and negatives (avoid) for one designer prompt."""

    positives: tuple[Example, ...] = ()
    negatives: tuple[Example, ...] = ()


ATTEMPT_VALID = "valid"
"""The outcome of a designer attempt that stored a valid environment."""
ATTEMPT_MALFORMED = "malformed"
"""The outcome of an answer with no parsable code block or hint (no check ran)."""
ATTEMPT_DUPLICATE = "duplicate"
"""The outcome of an answer whose code is already stored (after normalisation)."""


@dataclass(frozen=True)
class DesignerAttempt:
    """One designer attempt, whatever became of it (WAVE2 §6): validity figures count every one.

    Attributes:
        sample_id: The designer sample's id; an attempt recorded twice under it is stored once.
        setting: The kind of environment (game or tool).
        skill: The skill it was written for.
        batch_id: The regeneration round.
        weight_version: Policy version that wrote it.
        outcome: ``valid``, ``malformed``, ``duplicate`` or the name of the failing check.
        env_id: The environment it stored ("" when it stored none).
        spec_id: The run spec it was written under.
        created_at: When it was made (the store's clock when omitted).
    """

    sample_id: str
    setting: Setting
    skill: str
    outcome: str
    batch_id: str = ""
    weight_version: int = 0
    env_id: str = ""
    spec_id: str = ""
    created_at: datetime | None = None


@dataclass(frozen=True)
class RunSpecRecord:
    """The run spec the memory holds (one current spec; every service reads it at start).

    Attributes:
        spec_id: ``RunSpec.spec_id`` of ``spec_json``.
        spec_json: ``RunSpec.to_json()``: parse it with ``spade.runspec.RunSpec.from_json``.
        set_at: When it was stored.
    """

    spec_id: str
    spec_json: str
    set_at: datetime


@dataclass(frozen=True)
class EnvProbe:
    """What one reset of an environment showed, measured in the sandbox (``spade.pool_metrics.probe_env``).

    The memory never runs env code: whoever holds a sandbox reports this (``record_probe``).

    Attributes:
        env_id: The environment probed.
        first_observation: What ``reset(seed)`` returned to the agent.
        hidden_attributes: Attributes ``reset`` set (framework bookkeeping excluded) -> bytes of repr.
        solution: The winning actions of that instance (game envs; empty for tool envs).
        error: Why the probe failed ("" when it did not).
    """

    env_id: str
    first_observation: str = ""
    hidden_attributes: dict[str, int] = field(default_factory=dict)
    solution: tuple[str, ...] = ()
    error: str = ""


@dataclass(frozen=True)
class AttemptStats:
    """Every designer attempt the memory recorded (malformed answers included).

    Attributes:
        attempts: Attempts recorded.
        valid: Of them, those that stored a valid environment.
        validity_rate: ``valid / attempts``; ``None`` before the first attempt.
        by_outcome: Attempts per outcome (``valid``, ``malformed``, ``duplicate``, each failing check).
        by_round: The most recent rounds (``batch_id``), newest first: outcome -> attempts.
    """

    attempts: int = 0
    valid: int = 0
    validity_rate: float | None = None
    by_outcome: dict[str, int] = field(default_factory=dict)
    by_round: dict[str, dict[str, int]] = field(default_factory=dict)


@dataclass(frozen=True)
class PoolMetrics:
    """The pool's process metrics (issue 11), each computed with ``spade.pool_metrics`` / ``spade.signal``.

    The pool is every environment that passed validation (``valid`` or ``retired``), less those its
    audit plays retired as ``trivially_won`` (counted in ``audit_retired``).

    Attributes:
        envs: Environments in the pool.
        scored: Of them, those with a window win rate.
        learnable_fraction: ``spade.signal.learnable_fraction`` over every scored env.
        learnable_fraction_window: The same over the ``window`` most recently stored scored envs.
        window: Size of the sliding window of the windowed metrics.
        vendi_per_n: Vendi score / n of the last ``window`` pool envs' descriptions (code + first
            observation); ``None`` when not computed (``vendi_note`` says why).
        vendi_n: How many envs it covers.
        vendi_note: Why there is no Vendi figure ("" when there is).
        hash_distinct: Distinct pool envs by normalised code hash.
        distinct_documents: Distinct corpus documents the pool envs were grounded in.
        reward_levels_mean: Mean over played envs of the distinct reward values each emitted.
        interaction_turns_mean: Mean over played envs of their mean turns per play.
        program_lines_mean: Mean lines of code (not blank, not comment-only) of the pool envs.
        program_chars_mean: Mean characters of their code.
        probed: Pool envs with a sandbox probe (first observation, hidden state).
        hidden_state_size_mean: Mean attributes of hidden state ``reset`` sets, over probed envs.
        hidden_state_bytes_mean: Mean bytes of that state's ``repr``.
        leakage_share: Share of probed game envs whose first observation leaks the answer or formula.
        audit_retired: Envs that passed validation but were retired as ``trivially_won`` by the
            rollout's audit plays (a trivial policy won them on real rollout seeds).
    """

    envs: int = 0
    scored: int = 0
    learnable_fraction: float | None = None
    learnable_fraction_window: float | None = None
    window: int = 0
    vendi_per_n: float | None = None
    vendi_n: int = 0
    vendi_note: str = ""
    hash_distinct: int = 0
    distinct_documents: int = 0
    reward_levels_mean: float | None = None
    interaction_turns_mean: float | None = None
    program_lines_mean: float | None = None
    program_chars_mean: float | None = None
    probed: int = 0
    hidden_state_size_mean: float | None = None
    hidden_state_bytes_mean: float | None = None
    leakage_share: float | None = None
    audit_retired: int = 0


@dataclass(frozen=True)
class MemoryStats:
    """Aggregates over the whole memory (``GET /v1/stats``, the page, and each step's ``metrics.jsonl``).

    Attributes:
        total: Environments stored (every status).
        by_status: Environments per status.
        by_skill: Environments per skill.
        scored: Environments with a window win rate.
        learnable_fraction: ``spade.signal.learnable_fraction`` over the scored environments.
        mean_regret: Mean regret of the environments whose regret is measured.
        validity_rate: Valid attempts / designer attempts (malformed answers count); ``None`` before
            the first recorded attempt.
        plays: Plays recorded.
        resource_fault_plays: Of them, those that ended in a resource fault (counted as return 0).
        plays_by_finish_reason: Plays per finish reason.
        attempts: The designer attempts' figures.
        pool: The pool's process metrics.
        spec_id: The stored run spec's id ("" before one is set).
    """

    total: int
    by_status: dict[str, int]
    by_skill: dict[str, int]
    scored: int
    learnable_fraction: float | None
    mean_regret: float | None
    validity_rate: float | None
    plays: int
    resource_fault_plays: int = 0
    plays_by_finish_reason: dict[str, int] = field(default_factory=dict)
    attempts: AttemptStats = field(default_factory=AttemptStats)
    pool: PoolMetrics = field(default_factory=PoolMetrics)
    spec_id: str = ""

    def metrics(self) -> dict[str, float | int | None]:
        """Flat figures for ``metrics.jsonl`` (``pool/...``, ``designer/...``, ``memory/...``)."""
        flat: dict[str, float | int | None] = {
            "memory/envs": self.total,
            "memory/plays": self.plays,
            "memory/resource_fault_plays": self.resource_fault_plays,
            "memory/mean_regret": self.mean_regret,
            "designer/attempts": self.attempts.attempts,
            "designer/valid_attempts": self.attempts.valid,
            "designer/validity_rate": self.attempts.validity_rate,
        }
        flat.update({f"designer/outcome/{k}": v for k, v in sorted(self.attempts.by_outcome.items())})
        flat.update({f"pool/{k}": v for k, v in vars(self.pool).items() if not isinstance(v, str)})
        return flat
