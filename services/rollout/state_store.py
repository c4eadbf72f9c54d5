"""The rollout's durable state: the active env set, each env's window progress, the latest version.

Two small tables the rollout owns (``rollout_envs``, ``rollout_meta``), created on start-up if
missing, in SQLite (embedded mode) or Postgres (distributed mode; every rollout worker shares it).
Workers coordinate through it: a window play is claimed with a lease (compare-and-set on the row),
so one worker plays each due version and a worker that dies mid-play loses its lease to another.

All calls are synchronous SQL on a small pool, run in a thread so the event loop never blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import sqlalchemy as sa

from services.rollout.core.schedule import ActiveEnv, EnvStatus, due_version, window_closed

_metadata = sa.MetaData()

rollout_envs = sa.Table(
    "rollout_envs",
    _metadata,
    sa.Column("env_id", sa.String(200), primary_key=True),
    sa.Column("setting", sa.String(16), nullable=False),
    sa.Column("skill", sa.String(200), nullable=False),
    sa.Column("designer_sample_id", sa.String(200), nullable=False),
    sa.Column("first_version", sa.BigInteger, nullable=False),
    sa.Column("window", sa.Integer, nullable=False),
    sa.Column("played_through", sa.BigInteger, nullable=True),
    sa.Column("status", sa.String(16), nullable=False, index=True),
    sa.Column("lease_owner", sa.String(200), nullable=True),
    sa.Column("lease_until", sa.Float, nullable=True),
    sa.Column("updated_at", sa.Float, nullable=False),
)

rollout_meta = sa.Table(
    "rollout_meta",
    _metadata,
    sa.Column("key", sa.String(64), primary_key=True),
    sa.Column("value", sa.BigInteger, nullable=False),
)

_LATEST = "latest_weight_version"


def _to_env(row: sa.Row[tuple[object, ...]]) -> ActiveEnv:
    m = row._mapping
    return ActiveEnv(
        env_id=m["env_id"],
        setting=m["setting"],
        skill=m["skill"],
        designer_sample_id=m["designer_sample_id"],
        first_version=int(m["first_version"]),
        window=int(m["window"]),
        played_through=None if m["played_through"] is None else int(m["played_through"]),
        status=EnvStatus(m["status"]),
    )


class RolloutStateStore:
    """The active set and window progress in SQL.

    Args:
        engine: A SQLAlchemy engine (``sqlite:///…`` or ``postgresql+psycopg://…``).
        clock: Wall clock for leases (injectable in tests).
    """

    def __init__(self, engine: sa.Engine, *, clock: Callable[[], float] = time.time) -> None:
        self._engine = engine
        self._clock = clock
        _metadata.create_all(engine)

    @classmethod
    def from_url(cls, url: str, *, clock: Callable[[], float] = time.time) -> RolloutStateStore:
        """Open (and create if needed) the state tables at ``url``."""
        connect_args = {"timeout": 30} if url.startswith("sqlite") else {}
        return cls(sa.create_engine(url, pool_pre_ping=True, connect_args=connect_args), clock=clock)

    def dispose(self) -> None:
        """Close pooled connections."""
        self._engine.dispose()

    async def register(self, env: ActiveEnv) -> ActiveEnv:
        """Add ``env`` unless it is already known; return the stored row (the first registration wins)."""
        return await asyncio.to_thread(self._register, env)

    def _register(self, env: ActiveEnv) -> ActiveEnv:
        existing = self._get(env.env_id)
        if existing is not None:
            return existing
        # Own transaction: on Postgres a failed insert poisons its transaction.
        with contextlib.suppress(sa.exc.IntegrityError), self._engine.begin() as conn:
            conn.execute(
                rollout_envs.insert().values(
                    env_id=env.env_id,
                    setting=env.setting,
                    skill=env.skill,
                    designer_sample_id=env.designer_sample_id,
                    first_version=env.first_version,
                    window=env.window,
                    played_through=env.played_through,
                    status=env.status.value,
                    updated_at=self._clock(),
                )
            )
        got = self._get(env.env_id)  # ours, or the one another worker inserted first
        assert got is not None
        return got

    async def get(self, env_id: str) -> ActiveEnv | None:
        """The stored env, or None."""
        return await asyncio.to_thread(self._get, env_id)

    def _get(self, env_id: str) -> ActiveEnv | None:
        with self._engine.connect() as conn:
            row = conn.execute(sa.select(rollout_envs).where(rollout_envs.c.env_id == env_id)).first()
        return None if row is None else _to_env(row)

    async def envs(self, status: EnvStatus | None = None) -> list[ActiveEnv]:
        """Every stored env (optionally of one status), oldest first."""
        return await asyncio.to_thread(self._envs, status)

    def _envs(self, status: EnvStatus | None) -> list[ActiveEnv]:
        query = sa.select(rollout_envs).order_by(rollout_envs.c.first_version, rollout_envs.c.env_id)
        if status is not None:
            query = query.where(rollout_envs.c.status == status.value)
        with self._engine.connect() as conn:
            return [_to_env(r) for r in conn.execute(query)]

    async def observe_version(self, version: int) -> int:
        """Raise the latest known weight version to ``version`` (never lowers it); return the latest."""
        return await asyncio.to_thread(self._observe_version, version)

    def _observe_version(self, version: int) -> int:
        raise_latest = (
            rollout_meta.update()
            .where(rollout_meta.c.key == _LATEST, rollout_meta.c.value < version)
            .values(value=version)
        )
        with self._engine.begin() as conn:
            conn.execute(raise_latest)
        if self._latest() is None:
            with contextlib.suppress(sa.exc.IntegrityError), self._engine.begin() as conn:
                conn.execute(rollout_meta.insert().values(key=_LATEST, value=version))
            with self._engine.begin() as conn:  # a concurrent first insert may have been lower
                conn.execute(raise_latest)
        latest = self._latest()
        assert latest is not None
        return latest

    async def latest_version(self) -> int | None:
        """The newest weight version seen on ``weights.published`` (None before the first)."""
        return await asyncio.to_thread(self._latest)

    def _latest(self) -> int | None:
        with self._engine.connect() as conn:
            value = conn.execute(sa.select(rollout_meta.c.value).where(rollout_meta.c.key == _LATEST)).scalar()
        return None if value is None else int(value)

    async def claim_due(self, owner: str, lease_s: float) -> tuple[ActiveEnv, int] | None:
        """Lease one env whose window play is due (not its first plays: those follow the queue).

        Returns:
            The env and the version to play, or None when nothing is due or everything due is leased.
        """
        return await asyncio.to_thread(self._claim_due, owner, lease_s)

    def _claim_due(self, owner: str, lease_s: float) -> tuple[ActiveEnv, int] | None:
        latest = self._latest()
        now = self._clock()
        with self._engine.connect() as conn:
            rows = conn.execute(
                sa.select(rollout_envs)
                .where(
                    rollout_envs.c.status == EnvStatus.ACTIVE.value,
                    rollout_envs.c.played_through.is_not(None),
                    sa.or_(rollout_envs.c.lease_until.is_(None), rollout_envs.c.lease_until < now),
                )
                .order_by(rollout_envs.c.first_version, rollout_envs.c.env_id)
            ).all()
        for row in rows:
            env = _to_env(row)
            version = due_version(env, latest)
            if version is None:
                continue
            with self._engine.begin() as conn:
                won = conn.execute(
                    rollout_envs.update()
                    .where(
                        rollout_envs.c.env_id == env.env_id,
                        rollout_envs.c.played_through == env.played_through,
                        sa.or_(rollout_envs.c.lease_until.is_(None), rollout_envs.c.lease_until < now),
                    )
                    .values(lease_owner=owner, lease_until=now + lease_s, updated_at=now)
                ).rowcount
            if won:
                return env, version
        return None

    async def extend(self, env_id: str, owner: str, lease_s: float) -> bool:
        """Renew ``owner``'s lease on ``env_id`` for ``lease_s`` more; False when it was lost."""
        return await asyncio.to_thread(self._extend, env_id, owner, lease_s)

    def _extend(self, env_id: str, owner: str, lease_s: float) -> bool:
        now = self._clock()
        with self._engine.begin() as conn:
            renewed = conn.execute(
                rollout_envs.update()
                .where(
                    rollout_envs.c.env_id == env_id,
                    rollout_envs.c.lease_owner == owner,
                    rollout_envs.c.lease_until >= now,
                )
                .values(lease_until=now + lease_s, updated_at=now)
            ).rowcount
        return bool(renewed)

    async def release(self, env_id: str, owner: str) -> None:
        """Give up a lease without progress (the play failed; another worker may retry it)."""
        await asyncio.to_thread(self._release, env_id, owner)

    def _release(self, env_id: str, owner: str) -> None:
        with self._engine.begin() as conn:
            conn.execute(
                rollout_envs.update()
                .where(rollout_envs.c.env_id == env_id, rollout_envs.c.lease_owner == owner)
                .values(lease_owner=None, lease_until=None, updated_at=self._clock())
            )

    async def complete(self, env_id: str, version: int) -> ActiveEnv:
        """Record that the plays of ``version`` are durable; close the window if it is over.

        Raises:
            KeyError: Unknown env.
        """
        return await asyncio.to_thread(self._complete, env_id, version)

    def _complete(self, env_id: str, version: int) -> ActiveEnv:
        env = self._get(env_id)
        if env is None:
            raise KeyError(f"env {env_id!r} is not in the rollout's active set; register it first")
        if env.played_through is not None and env.played_through >= version:
            return env  # a re-delivered or re-claimed play finished twice: keep the furthest progress
        updated = env.played(version)
        status = EnvStatus.CLOSED if window_closed(updated, self._latest()) else env.status
        with self._engine.begin() as conn:
            conn.execute(
                rollout_envs.update()
                .where(rollout_envs.c.env_id == env_id)
                .values(
                    played_through=version,
                    status=status.value,
                    lease_owner=None,
                    lease_until=None,
                    updated_at=self._clock(),
                )
            )
        got = self._get(env_id)
        assert got is not None
        return got

    async def close_passed_windows(self) -> list[ActiveEnv]:
        """Mark active envs whose window the latest version has passed as closed; return every closed env."""
        return await asyncio.to_thread(self._close_passed)

    def _close_passed(self) -> list[ActiveEnv]:
        latest = self._latest()
        for env in self._envs(EnvStatus.ACTIVE):
            if window_closed(env, latest):
                with self._engine.begin() as conn:
                    conn.execute(
                        rollout_envs.update()
                        .where(rollout_envs.c.env_id == env.env_id, rollout_envs.c.status == EnvStatus.ACTIVE.value)
                        .values(status=EnvStatus.CLOSED.value, updated_at=self._clock())
                    )
        return self._envs(EnvStatus.CLOSED)

    async def abandon(self, env_id: str) -> None:
        """Close an env's window without plays (its first plays keep failing); it retires like any other."""
        await asyncio.to_thread(self._abandon, env_id)

    def _abandon(self, env_id: str) -> None:
        with self._engine.begin() as conn:
            conn.execute(
                rollout_envs.update()
                .where(rollout_envs.c.env_id == env_id, rollout_envs.c.status == EnvStatus.ACTIVE.value)
                .values(status=EnvStatus.CLOSED.value, lease_owner=None, lease_until=None, updated_at=self._clock())
            )

    async def mark_retired(self, env_id: str) -> None:
        """The memory knows the window closed: the env leaves the active set for good."""
        await asyncio.to_thread(self._mark_retired, env_id)

    def _mark_retired(self, env_id: str) -> None:
        with self._engine.begin() as conn:
            conn.execute(
                rollout_envs.update()
                .where(rollout_envs.c.env_id == env_id)
                .values(status=EnvStatus.RETIRED.value, lease_owner=None, lease_until=None, updated_at=self._clock())
            )
