"""The memory's SQL store: environments, plays and statistics in Postgres or a SQLite file.

All methods are synchronous and each runs in one transaction; ``MemoryService`` calls them from a
worker thread. Concurrency-safe on Postgres: the unique constraints on the normalised-code hash and
on the trajectory id decide races, and the loser re-reads instead of failing.
"""

from __future__ import annotations

import base64
import binascii
import math
import uuid
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, Integer, Select, cast, create_engine, event, func, or_, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from services.memory.core.normalise import code_hash
from services.memory.core.scoring import ScoringConfig, score
from services.memory.store.models import EnvironmentRow, EnvStatsRow, PlayRow
from spade.memory.errors import EnvironmentNotFound, InvalidArgument
from spade.memory.records import (
    Candidate,
    EnvFilter,
    Environment,
    EnvStats,
    EnvStatus,
    MemoryStats,
    NewEnvironment,
    Page,
    Play,
    PutResult,
    RecordResult,
    StatsUpdate,
)

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"
MAX_PAGE = 1000


def make_engine(url: str, **kwargs: Any) -> Engine:
    """Create an engine for ``url``; SQLite files get WAL, foreign keys and a busy timeout."""
    if url.startswith("sqlite"):
        kwargs.setdefault("connect_args", {}).setdefault("check_same_thread", False)
        engine = create_engine(url, **kwargs)

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA busy_timeout=10000")
            cur.close()

        return engine
    kwargs.setdefault("pool_pre_ping", True)
    return create_engine(url, **kwargs)


def migrate(engine: Engine, revision: str = "head") -> None:
    """Bring the schema to ``revision`` with the Alembic migrations (idempotent)."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)


def encode_cursor(seq: int) -> str:
    """Opaque cursor for the keyset position ``seq``."""
    return base64.urlsafe_b64encode(f"v1:{seq}".encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> int:
    """Inverse of ``encode_cursor``.

    Raises:
        InvalidArgument: The cursor was not issued by this service.
    """
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        tag, _, seq = raw.partition(":")
        if tag != "v1":
            raise ValueError(tag)
        return int(seq)
    except (ValueError, binascii.Error, UnicodeDecodeError):
        raise InvalidArgument(
            f"cursor {cursor[:40]!r} is not valid; pass back the next_cursor of a previous page unchanged"
        ) from None


def _now() -> datetime:
    return datetime.now(UTC)


def _aware(t: datetime) -> datetime:
    # SQLite returns naive datetimes for timezone-aware columns; everything stored is UTC.
    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)


def _stats(row: EnvStatsRow | None) -> EnvStats:
    if row is None:
        return EnvStats()
    return EnvStats(
        plays=row.plays,
        window_plays=row.window_plays,
        win_rate=row.win_rate,
        regret=row.regret,
        learnable=row.learnable,
        reward_components=dict(row.reward_components or {}),
    )


def _env(row: EnvironmentRow, stats: EnvStatsRow | None) -> Environment:
    return Environment(
        id=row.id,
        seq=row.seq,
        setting=row.setting,
        skill=row.skill,
        code=row.code,
        code_hash=row.code_hash,
        hint=row.hint,
        validation_report=dict(row.validation_report or {}),
        status=EnvStatus(row.status),
        weight_version=row.weight_version,
        designer_sample_id=row.designer_sample_id,
        env_class=row.env_class,
        corpus_ref=row.corpus_ref,
        batch_id=row.batch_id,
        parent_ids=tuple(row.parent_ids or ()),
        created_at=_aware(row.created_at),
        stats=_stats(stats),
    )


def _play(row: PlayRow) -> Play:
    return Play(
        env_id=row.env_id,
        seed=row.seed,
        hinted=row.hinted,
        episode_return=row.episode_return,
        turns=row.turns,
        weight_version=row.weight_version,
        trajectory_id=row.trajectory_id,
        finish_reason=row.finish_reason,
        played_at=_aware(row.played_at),
    )


class SqlStore:
    """Environments, plays and statistics in one SQL database.

    Args:
        engine: From ``make_engine``; the schema must be migrated (``migrate``).
        scoring: How plays become statistics.
    """

    def __init__(self, engine: Engine, scoring: ScoringConfig | None = None) -> None:
        self.engine = engine
        self.scoring = scoring or ScoringConfig()
        self._sessions = sessionmaker(engine, expire_on_commit=False)

    # -- environments -------------------------------------------------------------------------

    def put_environment(self, env: NewEnvironment) -> PutResult:
        """Store ``env`` unless its normalised code is already stored (then report the original)."""
        if env.setting not in ("game", "tool"):
            raise InvalidArgument(f"setting {env.setting!r} is not 'game' or 'tool'")
        if not env.skill or not env.code.strip():
            raise InvalidArgument("an environment needs a non-empty skill and code")
        try:
            status = EnvStatus(env.status)
        except ValueError:
            raise InvalidArgument(f"status {env.status!r} is not one of {[x.value for x in EnvStatus]}") from None
        digest = code_hash(env.code)
        env_id = uuid.uuid4().hex
        now = _now()
        try:
            with self._sessions.begin() as s:
                existing = s.scalar(select(EnvironmentRow.id).where(EnvironmentRow.code_hash == digest))
                if existing is not None:
                    return PutResult(env_id=existing, duplicate_of=existing)
                s.add(
                    EnvironmentRow(
                        id=env_id,
                        setting=env.setting,
                        skill=env.skill,
                        code=env.code,
                        code_hash=digest,
                        hint=env.hint,
                        env_class=env.env_class,
                        corpus_ref=env.corpus_ref,
                        validation_report=env.validation_report,
                        status=status.value,
                        weight_version=env.weight_version,
                        designer_sample_id=env.designer_sample_id,
                        batch_id=env.batch_id,
                        parent_ids=list(env.parent_ids),
                        created_at=now,
                    )
                )
                s.flush()
                s.add(
                    EnvStatsRow(
                        env_id=env_id,
                        plays=0,
                        window_plays=0,
                        learnable=False,
                        reward_components={},
                        updated_at=now,
                    )
                )
        except IntegrityError:
            # A concurrent put of the same code won the unique constraint: report it.
            existing = self._id_for_hash(digest)
            if existing is None:
                raise
            return PutResult(env_id=existing, duplicate_of=existing)
        return PutResult(env_id=env_id)

    def _id_for_hash(self, digest: str) -> str | None:
        with self._sessions() as s:
            return s.scalar(select(EnvironmentRow.id).where(EnvironmentRow.code_hash == digest))

    def get_environment(self, env_id: str) -> Environment:
        """Return one environment with its statistics.

        Raises:
            EnvironmentNotFound: Unknown id.
        """
        with self._sessions() as s:
            row = s.execute(
                select(EnvironmentRow, EnvStatsRow)
                .outerjoin(EnvStatsRow, EnvStatsRow.env_id == EnvironmentRow.id)
                .where(EnvironmentRow.id == env_id)
            ).first()
            if row is None:
                raise EnvironmentNotFound(env_id)
            return _env(row[0], row[1])

    def _filtered(self, f: EnvFilter) -> Select[EnvironmentRow, EnvStatsRow]:
        stmt = select(EnvironmentRow, EnvStatsRow).join(EnvStatsRow, EnvStatsRow.env_id == EnvironmentRow.id)
        if f.setting is not None:
            stmt = stmt.where(EnvironmentRow.setting == f.setting)
        if f.skill is not None:
            stmt = stmt.where(EnvironmentRow.skill == f.skill)
        if f.status is not None:
            stmt = stmt.where(EnvironmentRow.status == EnvStatus(f.status).value)
        if f.min_regret is not None:
            stmt = stmt.where(EnvStatsRow.regret >= f.min_regret)
        if f.max_win_rate is not None:
            stmt = stmt.where(EnvStatsRow.win_rate <= f.max_win_rate)
        if f.q:
            stmt = stmt.where(
                or_(
                    EnvironmentRow.code.icontains(f.q, autoescape=True),
                    EnvironmentRow.hint.icontains(f.q, autoescape=True),
                )
            )
        return stmt

    def list_environments(self, f: EnvFilter, limit: int = 50, cursor: str | None = None) -> Page:
        """One page of environments matching ``f``, newest first.

        Raises:
            InvalidArgument: ``limit`` outside [1, 1000] or a cursor not issued here.
        """
        if not 1 <= limit <= MAX_PAGE:
            raise InvalidArgument(f"limit {limit} must be between 1 and {MAX_PAGE}")
        stmt = self._filtered(f)
        if cursor:
            stmt = stmt.where(EnvironmentRow.seq < decode_cursor(cursor))
        stmt = stmt.order_by(EnvironmentRow.seq.desc()).limit(limit + 1)
        with self._sessions() as s:
            rows = s.execute(stmt).all()
        items = tuple(_env(r[0], r[1]) for r in rows[:limit])
        next_cursor = encode_cursor(items[-1].seq) if len(rows) > limit else None
        return Page(items=items, next_cursor=next_cursor)

    def iter_environments(self, f: EnvFilter, batch: int = 500) -> Iterator[Environment]:
        """Every environment matching ``f``, newest first, fetched in keyset batches (for export)."""
        cursor: str | None = None
        while True:
            page = self.list_environments(f, limit=batch, cursor=cursor)
            yield from page.items
            if page.next_cursor is None:
                return
            cursor = page.next_cursor

    def scored_window(self, setting: str, skill: str, size: int) -> list[Candidate]:
        """The ``size`` most recent scored environments of a setting and skill (policy input, no code)."""
        stmt = (
            select(
                EnvironmentRow.id,
                EnvironmentRow.seq,
                EnvironmentRow.skill,
                EnvStatsRow.win_rate,
                EnvStatsRow.regret,
                EnvStatsRow.window_plays,
            )
            .join(EnvStatsRow, EnvStatsRow.env_id == EnvironmentRow.id)
            .where(
                EnvironmentRow.setting == setting,
                EnvironmentRow.skill == skill,
                EnvStatsRow.win_rate.is_not(None),
            )
            .order_by(EnvironmentRow.seq.desc())
            .limit(size)
        )
        with self._sessions() as s:
            return [Candidate(*row) for row in s.execute(stmt).all()]

    def codes(self, env_ids: Sequence[str]) -> dict[str, str]:
        """Code of each of ``env_ids`` that exists."""
        if not env_ids:
            return {}
        with self._sessions() as s:
            rows = s.execute(select(EnvironmentRow.id, EnvironmentRow.code).where(EnvironmentRow.id.in_(env_ids)))
            return {i: c for i, c in rows.all()}

    # -- plays and statistics -----------------------------------------------------------------

    def record_plays(self, plays: Sequence[Play]) -> RecordResult:
        """Store plays (idempotent by trajectory id) and rescore the environments they touch.

        The batch is atomic: an unknown environment rejects all of it.

        Raises:
            EnvironmentNotFound: A play names an environment that is not stored.
            InvalidArgument: A play without a trajectory id, or the same id twice with other values.
        """
        for p in plays:
            if not p.trajectory_id:
                raise InvalidArgument(f"play of env {p.env_id!r} seed {p.seed} has no trajectory_id")
            if not math.isfinite(p.episode_return) or p.turns < 0:
                raise InvalidArgument(
                    f"play {p.trajectory_id!r} has return {p.episode_return} and turns {p.turns}; "
                    "returns must be finite and turns >= 0"
                )
        for _attempt in range(3):
            try:
                return self._record_once(plays)
            except IntegrityError:
                continue  # a concurrent writer recorded some of these; re-check and retry
        return self._record_once(plays)

    def _record_once(self, plays: Sequence[Play]) -> RecordResult:
        now = _now()
        with self._sessions.begin() as s:
            env_ids = {p.env_id for p in plays}
            known = dict(
                s.execute(
                    select(EnvironmentRow.id, EnvironmentRow.weight_version).where(EnvironmentRow.id.in_(env_ids))
                ).all()
            )
            missing = sorted(env_ids - known.keys())
            if missing:
                raise EnvironmentNotFound(missing[0])
            seen = set(
                s.scalars(
                    select(PlayRow.trajectory_id).where(PlayRow.trajectory_id.in_({p.trajectory_id for p in plays}))
                )
            )
            fresh: dict[str, Play] = {}
            for p in plays:
                if p.trajectory_id not in seen:
                    fresh.setdefault(p.trajectory_id, p)
            s.add_all(
                PlayRow(
                    env_id=p.env_id,
                    seed=p.seed,
                    hinted=p.hinted,
                    episode_return=p.episode_return,
                    turns=p.turns,
                    weight_version=p.weight_version,
                    trajectory_id=p.trajectory_id,
                    finish_reason=p.finish_reason,
                    played_at=p.played_at or now,
                )
                for p in fresh.values()
            )
            s.flush()
            for env_id in sorted({p.env_id for p in fresh.values()}):
                self._rescore(s, env_id, known[env_id], now)
        return RecordResult(recorded=len(fresh), duplicates=len(plays) - len(fresh))

    def _rescore(self, s: Session, env_id: str, first_version: int, now: datetime) -> None:
        row = s.get(EnvStatsRow, env_id, with_for_update=True)
        assert row is not None, "every environment has a stats row from put_environment"
        plays = [_play(r) for r in s.scalars(select(PlayRow).where(PlayRow.env_id == env_id))]
        st = score(plays, first_version, self.scoring, _stats(row))
        row.plays, row.window_plays, row.win_rate, row.regret = st.plays, st.window_plays, st.win_rate, st.regret
        row.learnable, row.updated_at = st.learnable, now

    def update_stats(self, env_id: str, update: StatsUpdate) -> Environment:
        """Merge the learner's reward components, set the learnable flag or move the status.

        Raises:
            EnvironmentNotFound: Unknown id.
        """
        with self._sessions.begin() as s:
            row = s.get(EnvStatsRow, env_id, with_for_update=True)
            env = s.scalar(select(EnvironmentRow).where(EnvironmentRow.id == env_id))
            if row is None or env is None:
                raise EnvironmentNotFound(env_id)
            bad = {k: v for k, v in update.reward_components.items() if not math.isfinite(v)}
            if bad:
                raise InvalidArgument(f"reward components must be finite numbers, got {bad}")
            components = dict(row.reward_components or {})
            components.update({k: float(v) for k, v in update.reward_components.items()})
            if update.learnable is not None:
                components["learnable_override"] = float(update.learnable)
                row.learnable = update.learnable
            row.reward_components = components
            row.updated_at = _now()
            if update.status is not None:
                env.status = EnvStatus(update.status).value
        return self.get_environment(env_id)

    def plays(self, env_id: str, limit: int = 200, cursor: str | None = None) -> tuple[list[Play], str | None]:
        """Plays of one environment, newest first, with the next page's cursor.

        Raises:
            EnvironmentNotFound: Unknown id.
            InvalidArgument: ``limit`` outside [1, 1000] or a bad cursor.
        """
        if not 1 <= limit <= MAX_PAGE:
            raise InvalidArgument(f"limit {limit} must be between 1 and {MAX_PAGE}")
        self.get_environment(env_id)
        stmt = select(PlayRow).where(PlayRow.env_id == env_id)
        if cursor:
            stmt = stmt.where(PlayRow.seq < decode_cursor(cursor))
        with self._sessions() as s:
            rows = list(s.scalars(stmt.order_by(PlayRow.seq.desc()).limit(limit + 1)))
        nxt = encode_cursor(rows[limit - 1].seq) if len(rows) > limit else None
        return [_play(r) for r in rows[:limit]], nxt

    def stats(self) -> MemoryStats:
        """Counts by status and skill, learnable fraction, mean regret and validity rate."""
        with self._sessions() as s:
            by_status = {
                k: int(v)
                for k, v in s.execute(select(EnvironmentRow.status, func.count()).group_by(EnvironmentRow.status)).all()
            }
            by_skill = {
                k: int(v)
                for k, v in s.execute(select(EnvironmentRow.skill, func.count()).group_by(EnvironmentRow.skill)).all()
            }
            scored, learnable, mean_regret = s.execute(
                select(
                    func.count(EnvStatsRow.win_rate),
                    func.sum(cast(EnvStatsRow.learnable, Integer)),
                    func.avg(EnvStatsRow.regret),
                )
            ).one()
            plays = int(s.scalar(select(func.count()).select_from(PlayRow)) or 0)
        total = sum(by_status.values())
        valid = by_status.get(EnvStatus.VALID.value, 0) + by_status.get(EnvStatus.RETIRED.value, 0)
        return MemoryStats(
            total=total,
            by_status=by_status,
            by_skill=by_skill,
            scored=int(scored or 0),
            learnable_fraction=(int(learnable or 0) / scored) if scored else None,
            mean_regret=float(mean_regret) if mean_regret is not None else None,
            validity_rate=valid / total if total else None,
            plays=plays,
        )

    def ping(self) -> None:
        """Run a trivial query (health check); raises when the database is unreachable."""
        with self._sessions() as s:
            s.execute(select(1))
