"""Plain records the memory stores and returns; no database or wire types here."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any


class EnvStatus(enum.StrEnum):
    """Where an environment is in its life.

    ``VALID`` passed every validation check and is in the pool; ``INVALID`` failed one (kept with its
    report for inspection and the designer's reward); ``RETIRED`` was valid and its window closed.
    """

    VALID = "valid"
    INVALID = "invalid"
    RETIRED = "retired"


class Setting(enum.StrEnum):
    """The two settings (DESIGN §1)."""

    GAME = "game"
    TOOL = "tool"


@dataclass(frozen=True)
class NewEnvironment:
    """An environment to store.

    Attributes:
        setting: ``"game"`` or ``"tool"``.
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

    setting: str
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

    Attributes:
        plays: Every recorded play (both arms, every version).
        window_plays: Unhinted plays inside the env's window of weight versions.
        win_rate: Windowed unhinted win rate; ``None`` until one such play exists (not yet scored).
        regret: Mean hinted minus mean unhinted return on the shared seeds at the first version;
            ``None`` until both arms have played a common seed.
        learnable: Win rate inside the learnable band (or as set by the learner).
        reward_components: The learner's designer-reward terms (regret_norm, plateau, blend ...).
    """

    plays: int = 0
    window_plays: int = 0
    win_rate: float | None = None
    regret: float | None = None
    learnable: bool = False
    reward_components: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Environment:
    """A stored environment with its statistics."""

    id: str
    seq: int
    setting: str
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
        finish_reason: How the episode ended (``terminated``, ``truncated``, ``turn_limit`` ...).
        played_at: When it was played (the store's clock when omitted).
    """

    env_id: str
    seed: int
    hinted: bool
    episode_return: float
    turns: int
    weight_version: int
    trajectory_id: str
    finish_reason: str = ""
    played_at: datetime | None = None


@dataclass(frozen=True)
class RecordResult:
    """Outcome of recording plays: how many were new, how many were already recorded."""

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

    setting: str | None = None
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


@dataclass(frozen=True)
class MemoryStats:
    """Aggregates over the whole memory (``GET /v1/stats``)."""

    total: int
    by_status: dict[str, int]
    by_skill: dict[str, int]
    scored: int
    learnable_fraction: float | None
    mean_regret: float | None
    validity_rate: float | None
    plays: int
