"""The memory's SQL store: environments, plays, statistics, designer attempts and the run spec.

Postgres or a SQLite file. All methods are synchronous and each runs in one transaction;
``MemoryService`` calls them from a worker thread. Concurrency-safe on both databases: the unique
constraints on the normalised-code hash, the trajectory id, the attempt's sample id and the run
spec's single slot decide races, and the loser re-reads instead of failing; an env's window is
fixed by one conditional ``UPDATE`` (first writer wins).
"""

from __future__ import annotations

import math
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, ExceptionContext, Select, create_engine, event, or_, select, update
from sqlalchemy.orm import Session, sessionmaker

from services.memory.core.normalise import code_hash, env_id_for
from services.memory.core.scoring import LEARNABLE_OVERRIDE, score, shape
from services.memory.store.models import (
    EnvironmentRow,
    EnvStatsRow,
    PlayRow,
    RunSpecRow,
)
from services.memory.store.pages import as_utc, check_limit, decode_cursor, encode_cursor, first_of_each, utc_now
from services.memory.store.pool_stats import fingerprint, memory_stats
from services.memory.store.run_records import RunRecords
from services.memory.store.web_sessions import WebSessions
from spade import pool_metrics
from spade.envs.types import FinishReason, Setting
from spade.memory.errors import DatabaseUnavailable, EnvironmentNotFound, InvalidArgument
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
from spade.pool_metrics import program_length
from spade.runspec import RunSpec
from spade.sql import insert_new

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"
MAX_WINDOW_VERSIONS = 1_000_000
"""Longest window an env may be given (the seed pool's spans a whole run)."""
KNOWN_FINISH_REASONS = frozenset(reason.value for reason in FinishReason)
"""What a play's finish reason may be when it is stored (None, no reason said, is stored as ``""``)."""


def make_engine(url: str, **kwargs: Any) -> Engine:
    """Create an engine for ``url``; SQLite files get WAL, foreign keys and a busy timeout.

    A database that cannot be reached, or drops a connection mid-call, raises ``DatabaseUnavailable``.
    """
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

    else:
        kwargs.setdefault("pool_pre_ping", True)
        engine = create_engine(url, **kwargs)
    event.listen(engine, "handle_error", _unreachable)
    return engine


def _unreachable(context: ExceptionContext) -> None:
    """A failed connect or a dropped connection becomes ``DatabaseUnavailable`` (UNAVAILABLE on the wire):
    a service waiting for the memory waits through a database restart instead of failing on an
    internal error. A failed pre-ping is left to the pool, which reconnects on its own."""
    if context.is_pre_ping or not (context.is_disconnect or context.connection is None):
        return
    reason = type(context.original_exception).__name__
    raise DatabaseUnavailable(
        f"the memory's database did not answer ({reason}): it is down or restarting; retry shortly"
    ) from context.original_exception


def migrate(engine: Engine, revision: str = "head") -> None:
    """Bring the schema to ``revision`` with the Alembic migrations (idempotent)."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)


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
        solved_fraction=row.solved_fraction,
        regret_note=row.regret_note or "",
    )


def _env(row: EnvironmentRow, stats: EnvStatsRow | None) -> Environment:
    return Environment(
        id=row.id,
        seq=row.seq,
        setting=Setting(row.setting),
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
        created_at=as_utc(row.created_at),
        stats=_stats(stats),
        window_start=row.window_start,
        window_versions=row.window_versions or 0,
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
        finish_reason=FinishReason.stored(row.finish_reason),
        played_at=as_utc(row.played_at),
        window_start=row.window_start,
        window_index=row.window_index,
        spec_id=row.spec_id,
    )


class SqlStore(RunRecords, WebSessions):
    """Environments, plays and statistics in one SQL database.

    Args:
        engine: From ``make_engine``; the schema must be migrated (``migrate``).
        window_versions: ``k`` per setting for envs whose window was never set (their plays predate
            ``set_window``); a setting missing here takes the stored run spec's k, else every slot counts.
        embedder: Sentence embedder of the Vendi metric (``spade.pool_metrics.MiniLMEmbedder``);
            ``None`` turns the metric off.
        embedding_model: The embedder's name, stored with each cached embedding.
        metrics_window: Envs in the sliding window of the windowed process metrics.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        window_versions: Mapping[str, int] | None = None,
        embedder: Any = None,
        embedding_model: str = "all-MiniLM-L6-v2",
        metrics_window: int = pool_metrics.DEFAULT_WINDOW,
        content_env_ids: bool = False,
    ) -> None:
        self.engine = engine
        self.content_env_ids = content_env_ids
        self.window_versions = dict(window_versions or {})
        self.embedder = embedder
        self.embedding_model = embedding_model
        self.metrics_window = metrics_window
        self._sessions = sessionmaker(engine, expire_on_commit=False)
        self._stats_lock = threading.Lock()
        self._stats_cache: tuple[tuple[Any, ...], MemoryStats, float] | None = None

    # -- environments -------------------------------------------------------------------------

    def put_environment(self, env: NewEnvironment) -> PutResult:
        """Store ``env`` unless its normalised code is already stored (then report the original)."""
        if env.setting not in tuple(Setting):
            raise InvalidArgument(f"setting {env.setting!r} is not 'game' or 'tool'")
        if not env.skill or not env.code.strip():
            raise InvalidArgument("an environment needs a non-empty skill and code")
        try:
            status = EnvStatus(env.status)
        except ValueError:
            raise InvalidArgument(f"status {env.status!r} is not one of {[x.value for x in EnvStatus]}") from None
        digest = code_hash(env.code)
        length = program_length(env.code)
        env_id = env_id_for(digest) if self.content_env_ids else uuid.uuid4().hex
        now = utc_now()
        row = {
            "id": env_id,
            "setting": env.setting,
            "skill": env.skill,
            "code": env.code,
            "code_hash": digest,
            "hint": env.hint,
            "env_class": env.env_class,
            "corpus_ref": env.corpus_ref,
            "validation_report": env.validation_report,
            "status": status.value,
            "weight_version": env.weight_version,
            "designer_sample_id": env.designer_sample_id,
            "batch_id": env.batch_id,
            "parent_ids": list(env.parent_ids),
            "created_at": now,
            "window_versions": 0,
            "program_lines": length.lines,
            "program_chars": length.chars,
        }
        table = EnvironmentRow.__table__
        with self._sessions.begin() as s:
            # The same code already stored (or stored by a concurrent put, which this insert waits
            # for): nothing is inserted and the original is reported.
            stmt = insert_new(table, s.get_bind().dialect.name).values(row).returning(table.c.id)
            if s.execute(stmt).scalar() is None:
                existing = s.scalar(select(EnvironmentRow.id).where(EnvironmentRow.code_hash == digest))
                if existing is None:
                    raise RuntimeError(f"environment id {env_id} is taken by other code (a content id collision)")
                return PutResult(env_id=existing, duplicate_of=existing)
            s.add(
                EnvStatsRow(
                    env_id=env_id,
                    plays=0,
                    window_plays=0,
                    learnable=False,
                    reward_components={},
                    updated_at=now,
                    regret_note="",
                    reward_levels=0,
                )
            )
        return PutResult(env_id=env_id)

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
        check_limit(limit)
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
            InvalidArgument: A play without a trajectory id, a return outside [0, 1], negative turns,
                a negative window slot or a finish reason that is not a ``FinishReason``.
        """
        for p in plays:
            if not p.trajectory_id:
                raise InvalidArgument(f"play of env {p.env_id!r} seed {p.seed} has no trajectory_id")
            if p.finish_reason is not None and p.finish_reason not in KNOWN_FINISH_REASONS:
                raise InvalidArgument(
                    f"play {p.trajectory_id!r} has finish reason {p.finish_reason!r}, not one of "
                    f"{sorted(KNOWN_FINISH_REASONS)}"
                )
            if not (math.isfinite(p.episode_return) and 0.0 <= p.episode_return <= 1.0) or p.turns < 0:
                raise InvalidArgument(
                    f"play {p.trajectory_id!r} has return {p.episode_return} and turns {p.turns}; "
                    "returns are rewards in [0, 1] (the env contract) and turns must be >= 0"
                )
            if p.window_index < 0 or p.window_start < 0:
                raise InvalidArgument(
                    f"play {p.trajectory_id!r} has window slot {p.window_index} of a window starting at "
                    f"{p.window_start}; both must be >= 0 (slot 0 is the env's first window version)"
                )
        now = utc_now()
        rows = [
            {
                "env_id": p.env_id,
                "seed": p.seed,
                "hinted": p.hinted,
                "episode_return": p.episode_return,
                "turns": p.turns,
                "weight_version": p.weight_version,
                "trajectory_id": p.trajectory_id,
                "finish_reason": p.finish_reason or "",
                "played_at": p.played_at or now,
                "window_start": p.window_start,
                "window_index": p.window_index,
                "spec_id": p.spec_id,
            }
            for p in first_of_each(plays, lambda p: p.trajectory_id)
        ]
        if not rows:
            return RecordResult(recorded=0, duplicates=0)
        table = PlayRow.__table__
        with self._sessions.begin() as s:
            env_ids = {p.env_id for p in plays}
            known = set(s.scalars(select(EnvironmentRow.id).where(EnvironmentRow.id.in_(env_ids))))
            missing = sorted(env_ids - known)
            if missing:
                raise EnvironmentNotFound(missing[0])
            stmt = insert_new(table, s.get_bind().dialect.name).values(rows).returning(table.c.env_id)
            recorded = s.execute(stmt).scalars().all()
            for env_id in sorted(set(recorded)):
                self._rescore(s, env_id, now)
        return RecordResult(recorded=len(recorded), duplicates=len(plays) - len(recorded))

    def _window_versions(self, s: Session, env: EnvironmentRow) -> int | None:
        """The env's k: its stored window, else the configured or the run spec's k for its setting."""
        if env.window_start is not None and env.window_versions > 0:
            return env.window_versions
        if env.setting in self.window_versions:
            return self.window_versions[env.setting]
        stored = s.scalar(select(RunSpecRow.spec_json))
        return RunSpec.from_json(stored).window_for(env.setting) if stored else None

    def _rescore(self, s: Session, env_id: str, now: datetime) -> None:
        row = s.get(EnvStatsRow, env_id, with_for_update=True)
        env = s.scalar(select(EnvironmentRow).where(EnvironmentRow.id == env_id))
        assert row is not None and env is not None, "every environment has a stats row from put_environment"
        plays = [_play(r) for r in s.scalars(select(PlayRow).where(PlayRow.env_id == env_id))]
        st = score(plays, self._window_versions(s, env), _stats(row))
        sh = shape(plays)
        row.plays, row.window_plays, row.win_rate, row.regret = st.plays, st.window_plays, st.win_rate, st.regret
        row.learnable, row.solved_fraction, row.regret_note = st.learnable, st.solved_fraction, st.regret_note
        row.reward_levels, row.turns_mean, row.updated_at = sh.reward_levels, sh.turns_mean, now

    def set_window(self, env_id: str, window_start: int, window_versions: int) -> Environment:
        """Fix the env's window unless one is already fixed (first writer wins); returns the stored one.

        One conditional ``UPDATE ... WHERE window_start IS NULL``: on Postgres a concurrent second
        writer waits for the first's row lock and then finds the window set; SQLite serialises writers.

        Raises:
            EnvironmentNotFound: Unknown id.
            InvalidArgument: A negative start or a length outside [1, 1000000].
        """
        if window_start < 0 or not 1 <= window_versions <= MAX_WINDOW_VERSIONS:
            raise InvalidArgument(
                f"window_start {window_start} must be >= 0 and window_versions {window_versions} between 1 "
                f"and {MAX_WINDOW_VERSIONS}: the window is the rollout's version when it first plays the env, "
                "and k"
            )
        with self._sessions.begin() as s:
            result = s.execute(
                update(EnvironmentRow)
                .where(EnvironmentRow.id == env_id, EnvironmentRow.window_start.is_(None))
                .values(window_start=window_start, window_versions=window_versions)
                .execution_options(synchronize_session=False)
            )
            fixed = getattr(result, "rowcount", 0)  # a CursorResult for an UPDATE
            if fixed:
                self._rescore(s, env_id, utc_now())
            elif s.scalar(select(EnvironmentRow.id).where(EnvironmentRow.id == env_id)) is None:
                raise EnvironmentNotFound(env_id)
        return self.get_environment(env_id)

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
                components[LEARNABLE_OVERRIDE] = float(update.learnable)
                row.learnable = update.learnable
            row.reward_components = components
            row.updated_at = utc_now()
            if update.status is not None:
                env.status = EnvStatus(update.status).value
        return self.get_environment(env_id)

    def plays(self, env_id: str, limit: int = 200, cursor: str | None = None) -> tuple[list[Play], str | None]:
        """Plays of one environment, newest first, with the next page's cursor.

        Raises:
            EnvironmentNotFound: Unknown id.
            InvalidArgument: ``limit`` outside [1, 1000] or a bad cursor.
        """
        check_limit(limit)
        self.get_environment(env_id)
        stmt = select(PlayRow).where(PlayRow.env_id == env_id)
        if cursor:
            stmt = stmt.where(PlayRow.seq < decode_cursor(cursor))
        with self._sessions() as s:
            rows = list(s.scalars(stmt.order_by(PlayRow.seq.desc()).limit(limit + 1)))
        nxt = encode_cursor(rows[limit - 1].seq) if len(rows) > limit else None
        return [_play(r) for r in rows[:limit]], nxt

    # -- aggregates -------------------------------------------------------------------------------

    def stats(self, max_age_s: float = 0.0) -> MemoryStats:
        """Counts, the signal's aggregates, the designer's attempts and the pool's process metrics.

        Cached until the database changes: a fingerprint of the latest writes (one cheap query per
        table) decides, so a write through any replica invalidates every replica's cache.

        Args:
            max_age_s: Serve the cached figures without looking at the database while they are younger
                than this (the REST API's refresh interval); 0 recomputes whenever anything changed.
        """
        with self._stats_lock:
            now = time.monotonic()
            if self._stats_cache is not None and now - self._stats_cache[2] < max_age_s:
                return self._stats_cache[1]
            with self._sessions() as s:
                key = fingerprint(s)
            if self._stats_cache is not None and self._stats_cache[0] == key:
                return self._stats_cache[1]
            with self._sessions.begin() as s:
                result = memory_stats(s, self.metrics_window, self.embedder, self.embedding_model)
            self._stats_cache = (key, result, time.monotonic())
            return result

    def ping(self) -> None:
        """Run a trivial query (health check); raises when the database is unreachable."""
        with self._sessions() as s:
            s.execute(select(1))
