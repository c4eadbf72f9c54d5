"""The rollout's durable state: the active envs, their window progress, leases, finished plays.

Three small tables the rollout owns, created on start-up if missing, in SQLite (embedded mode) or
Postgres (distributed mode; every rollout worker shares it):

- ``rollout_windows``: one row per env: its window (start, k), how many slots are durable, status,
  the lease on its next slot (owner, expiry, claims so far, last error) and the slots skipped with
  their reasons;
- ``rollout_plays``: the sample id of every play that is published and recorded, so a slot that is
  resumed (after a crash, a takeover or SIGTERM) plays only what is missing;
- ``rollout_meta``: the latest weight version seen;
- ``rollout_audits``: each env's audit verdict (``core/audit.py``), first writer wins, so a slot 0
  resumed after the audit does not play it again, and the env retires with the verdict's status.

Leases follow liveness: a worker claims an env's due slot for ``lease_s`` seconds (compare-and-set
on the row) and renews it while the plays run. A worker restarted under the same name takes its own
leases back at once; another worker takes a lease over once it expired. Lease times are the
database's clock (one clock for every worker), unless a test injects one.

All calls are synchronous SQL on a small pool, run in a thread so the event loop never blocks.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from services.rollout.core.audit import AuditVerdict
from services.rollout.core.schedule import ActiveEnv, EnvStatus, due_slot
from spade.dependencies import DEFAULT_WAIT
from spade.retry import RetryPolicy
from spade.serving.logs import get_logger
from spade.sql import insert_new

log = get_logger(__name__)

_metadata = sa.MetaData()

rollout_windows = sa.Table(
    "rollout_windows",
    _metadata,
    sa.Column("env_id", sa.String(200), primary_key=True),
    sa.Column("setting", sa.String(16), nullable=False),
    sa.Column("skill", sa.String(200), nullable=False),
    sa.Column("designer_sample_id", sa.String(200), nullable=False),
    sa.Column("spec_id", sa.String(64), nullable=False),
    sa.Column("design_version", sa.BigInteger, nullable=False),
    sa.Column("window", sa.Integer, nullable=False),
    sa.Column("window_start", sa.BigInteger, nullable=True),
    sa.Column("slots_done", sa.Integer, nullable=False),
    sa.Column("status", sa.String(16), nullable=False, index=True),
    sa.Column("lease_owner", sa.String(200), nullable=True),
    sa.Column("lease_until", sa.Float, nullable=True),
    sa.Column("attempts", sa.Integer, nullable=False),
    sa.Column("last_error", sa.Text, nullable=True),
    sa.Column("skipped", sa.Text, nullable=False),
    sa.Column("registered_at", sa.Float, nullable=False),
    sa.Column("updated_at", sa.Float, nullable=False),
)

rollout_plays = sa.Table(
    "rollout_plays",
    _metadata,
    sa.Column("sample_id", sa.String(400), primary_key=True),
    sa.Column("env_id", sa.String(200), nullable=False, index=True),
    sa.Column("slot", sa.Integer, nullable=False),
)

rollout_meta = sa.Table(
    "rollout_meta",
    _metadata,
    sa.Column("key", sa.String(64), primary_key=True),
    sa.Column("value", sa.BigInteger, nullable=False),
)

rollout_audits = sa.Table(
    "rollout_audits",
    _metadata,
    sa.Column("env_id", sa.String(200), primary_key=True),
    sa.Column("trivially_won", sa.Boolean, nullable=False),
    sa.Column("verdict", sa.Text, nullable=False),
)

_LATEST = "latest_weight_version"


@dataclass(frozen=True)
class Claim:
    """A leased slot: the env, the slot to play, and how many times it has been claimed (this one included).

    ``previous_owner`` and ``previous_until`` are the lease this claim replaced, as the claim read it:
    another worker's that had lapsed (a takeover), the claimant's own (a worker restarted under its
    name), or ``None`` (a free slot).
    """

    env: ActiveEnv
    slot: int
    attempts: int
    last_error: str | None = None
    previous_owner: str | None = None
    previous_until: float | None = None


@dataclass(frozen=True)
class HeldSlot:
    """A slot under a worker's lease, as ``spade cluster status`` shows each worker's current work.

    Attributes:
        owner: The worker holding the lease (its consumer name).
        env_id: The env.
        slot: The window slot it is playing (the env's next slot).
        expires_in_s: Seconds until the lease lapses unless renewed (the database's clock); negative:
            it has lapsed and any worker may take it over.
        attempts: Claims of this slot so far (this one included).
    """

    owner: str
    env_id: str
    slot: int
    expires_in_s: float
    attempts: int


@dataclass(frozen=True)
class SkippedSlot:
    """A window slot that was not played, and why (never skipped silently)."""

    slot: int
    reason: str


def _to_env(row: sa.Row[tuple[object, ...]]) -> ActiveEnv:
    m = row._mapping
    return ActiveEnv(
        env_id=m["env_id"],
        setting=m["setting"],
        skill=m["skill"],
        designer_sample_id=m["designer_sample_id"],
        window=int(m["window"]),
        design_version=int(m["design_version"]),
        spec_id=m["spec_id"],
        window_start=None if m["window_start"] is None else int(m["window_start"]),
        slots_done=int(m["slots_done"]),
        status=EnvStatus(m["status"]),
    )


class RolloutStateStore:
    """The active set, window progress, leases and finished plays in SQL.

    Args:
        engine: A SQLAlchemy engine (``sqlite:///…`` or ``postgresql+psycopg://…``).
        clock: Wall clock for leases (tests inject one); default: the database's own clock.
        wait: How long to keep trying to create the tables while the database does not answer (a
            worker started as Postgres restarts waits for it instead of exiting).
        create: Create the tables when missing (False: a reader that must not change the database).
    """

    def __init__(
        self,
        engine: sa.Engine,
        *,
        clock: Callable[[], float] | None = None,
        wait: RetryPolicy = DEFAULT_WAIT,
        create: bool = True,
    ) -> None:
        self._engine = engine
        self._clock = clock
        if not create:  # a reader (``spade cluster status``): no DDL against the rollout's database
            return
        what = "creating the rollout's state tables"
        for attempt in wait.retrying(sa.exc.OperationalError, logger=log, what=what):
            with attempt:
                _metadata.create_all(engine)

    @classmethod
    def from_url(
        cls, url: str, *, clock: Callable[[], float] | None = None, wait: RetryPolicy = DEFAULT_WAIT
    ) -> RolloutStateStore:
        """Open (and create if needed) the state tables at ``url``, waiting for the database (``wait``)."""
        connect_args = {"timeout": 30} if url.startswith("sqlite") else {}
        return cls(sa.create_engine(url, pool_pre_ping=True, connect_args=connect_args), clock=clock, wait=wait)

    def dispose(self) -> None:
        """Close pooled connections."""
        self._engine.dispose()

    def _now(self) -> sa.ColumnElement[Any]:
        """Now, as a SQL expression: one clock for every worker sharing the database."""
        if self._clock is not None:
            return sa.literal(self._clock(), sa.Float)
        if self._engine.dialect.name == "sqlite":
            return sa.literal_column("((julianday('now') - 2440587.5) * 86400.0)", sa.Float)
        return sa.func.extract("epoch", sa.func.clock_timestamp())

    def _now_value(self, conn: sa.Connection) -> float:
        if self._clock is not None:
            return self._clock()
        return float(conn.execute(sa.select(self._now())).scalar_one())

    # ---- registration and reads ------------------------------------------------------------------

    async def register(self, env: ActiveEnv) -> ActiveEnv:
        """Add ``env`` unless it is already known; return the stored row (the first registration wins)."""
        return await asyncio.to_thread(self._register, env)

    def _register(self, env: ActiveEnv) -> ActiveEnv:
        existing = self._get(env.env_id)
        if existing is not None:
            return existing
        with self._engine.begin() as conn:
            now = self._now_value(conn)
            conn.execute(
                insert_new(rollout_windows, conn.dialect.name).values(
                    env_id=env.env_id,
                    setting=env.setting,
                    skill=env.skill,
                    designer_sample_id=env.designer_sample_id,
                    spec_id=env.spec_id,
                    design_version=env.design_version,
                    window=env.window,
                    window_start=env.window_start,
                    slots_done=env.slots_done,
                    status=env.status.value,
                    attempts=0,
                    skipped="[]",
                    registered_at=now,
                    updated_at=now,
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
            row = conn.execute(sa.select(rollout_windows).where(rollout_windows.c.env_id == env_id)).first()
        return None if row is None else _to_env(row)

    async def envs(self, status: EnvStatus | None = None) -> list[ActiveEnv]:
        """Every stored env (optionally of one status), in registration order."""
        return await asyncio.to_thread(self._envs, status)

    def _envs(self, status: EnvStatus | None) -> list[ActiveEnv]:
        query = sa.select(rollout_windows).order_by(rollout_windows.c.registered_at, rollout_windows.c.env_id)
        if status is not None:
            query = query.where(rollout_windows.c.status == status.value)
        with self._engine.connect() as conn:
            return [_to_env(r) for r in conn.execute(query)]

    async def skipped(self, env_id: str) -> list[SkippedSlot]:
        """The slots of ``env_id`` that were skipped, with their reasons."""
        return await asyncio.to_thread(self._skipped, env_id)

    def _skipped(self, env_id: str) -> list[SkippedSlot]:
        with self._engine.connect() as conn:
            raw = conn.execute(sa.select(rollout_windows.c.skipped).where(rollout_windows.c.env_id == env_id)).scalar()
        return [SkippedSlot(int(s["slot"]), str(s["reason"])) for s in json.loads(raw or "[]")]

    async def lease(self, env_id: str) -> tuple[str | None, float | None]:
        """The current lease on ``env_id``: owner and expiry (for inspection and tests)."""
        return await asyncio.to_thread(self._lease, env_id)

    def _lease(self, env_id: str) -> tuple[str | None, float | None]:
        with self._engine.connect() as conn:
            row = conn.execute(
                sa.select(rollout_windows.c.lease_owner, rollout_windows.c.lease_until).where(
                    rollout_windows.c.env_id == env_id
                )
            ).first()
        return (None, None) if row is None else (row[0], row[1])

    # ---- audits -----------------------------------------------------------------------------------

    async def record_audit(self, verdict: AuditVerdict) -> AuditVerdict:
        """Keep ``verdict`` unless the env has one already; return the stored one (the first wins)."""
        return await asyncio.to_thread(self._record_audit, verdict)

    def _record_audit(self, verdict: AuditVerdict) -> AuditVerdict:
        with self._engine.begin() as conn:
            conn.execute(
                insert_new(rollout_audits, conn.dialect.name).values(
                    env_id=verdict.env_id, trivially_won=verdict.trivially_won, verdict=verdict.to_json()
                )
            )
        stored = self._audit(verdict.env_id)
        assert stored is not None
        return stored

    async def audit(self, env_id: str) -> AuditVerdict | None:
        """The env's audit verdict, or None before its audit."""
        return await asyncio.to_thread(self._audit, env_id)

    def _audit(self, env_id: str) -> AuditVerdict | None:
        with self._engine.connect() as conn:
            raw = conn.execute(sa.select(rollout_audits.c.verdict).where(rollout_audits.c.env_id == env_id)).scalar()
        return None if raw is None else AuditVerdict.from_json(raw)

    async def audits(self, *, trivially_won: bool | None = None) -> list[AuditVerdict]:
        """Every stored verdict (optionally only those that did or did not retire the env), by env id."""
        return await asyncio.to_thread(self._audits, trivially_won)

    def _audits(self, trivially_won: bool | None) -> list[AuditVerdict]:
        query = sa.select(rollout_audits.c.verdict).order_by(rollout_audits.c.env_id)
        if trivially_won is not None:
            query = query.where(rollout_audits.c.trivially_won == trivially_won)
        with self._engine.connect() as conn:
            return [AuditVerdict.from_json(raw) for raw in conn.execute(query).scalars()]

    # ---- weight versions ---------------------------------------------------------------------------

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
            with self._engine.begin() as conn:
                conn.execute(insert_new(rollout_meta, conn.dialect.name).values(key=_LATEST, value=version))
            with self._engine.begin() as conn:  # a concurrent first insert may have been lower
                conn.execute(raise_latest)
        latest = self._latest()
        assert latest is not None
        return latest

    async def latest_version(self) -> int | None:
        """The newest weight version seen (None before the first)."""
        return await asyncio.to_thread(self._latest)

    def _latest(self) -> int | None:
        with self._engine.connect() as conn:
            value = conn.execute(sa.select(rollout_meta.c.value).where(rollout_meta.c.key == _LATEST)).scalar()
        return None if value is None else int(value)

    # ---- leases ------------------------------------------------------------------------------------

    def _claimable(self, owner: str, now: sa.ColumnElement[Any]) -> sa.ColumnElement[bool]:
        c = rollout_windows.c
        return sa.or_(c.lease_until.is_(None), c.lease_until < now, c.lease_owner == owner)

    async def claim(self, owner: str, lease_s: float, busy: Collection[str] = ()) -> Claim | None:
        """Lease the next due slot of one env for ``lease_s`` seconds.

        An env is claimable when its lease expired, or is ``owner``'s own (a worker restarted under
        the same name resumes its work at once); ``busy`` are the envs ``owner`` is playing now.

        Returns:
            The claim, or None when nothing is due or everything due is leased.
        """
        return await asyncio.to_thread(self._claim, owner, lease_s, frozenset(busy))

    def _claim(self, owner: str, lease_s: float, busy: frozenset[str]) -> Claim | None:
        latest = self._latest()
        c = rollout_windows.c
        with self._engine.connect() as conn:
            rows = conn.execute(
                sa.select(rollout_windows)
                .where(c.status == EnvStatus.ACTIVE.value, self._claimable(owner, self._now()))
                .order_by(c.registered_at, c.env_id)
            ).all()
        for row in rows:
            env = _to_env(row)
            if env.env_id in busy:
                continue
            slot = due_slot(env, latest)
            if slot is None:
                continue
            with self._engine.begin() as conn:
                now = self._now()
                won = conn.execute(
                    rollout_windows.update()
                    .where(
                        c.env_id == env.env_id,
                        c.slots_done == env.slots_done,
                        c.status == EnvStatus.ACTIVE.value,
                        self._claimable(owner, now),
                    )
                    .values(lease_owner=owner, lease_until=now + lease_s, attempts=c.attempts + 1, updated_at=now)
                ).rowcount
                if won:
                    attempts, error = conn.execute(
                        sa.select(c.attempts, c.last_error).where(c.env_id == env.env_id)
                    ).one()
            if won:
                m = row._mapping
                until = None if m["lease_until"] is None else float(m["lease_until"])
                return Claim(env, slot, int(attempts), error, m["lease_owner"], until)
        return None

    async def due_envs(self) -> set[str]:
        """The active envs with a slot due at the latest version, leased or not (an env held back after a
        failed slot counts as due, though :meth:`claim` leaves it until its hold ends)."""
        return await asyncio.to_thread(self._due_envs)

    def _due_envs(self) -> set[str]:
        latest = self._latest()
        c = rollout_windows.c
        with self._engine.connect() as conn:
            rows = conn.execute(sa.select(rollout_windows).where(c.status == EnvStatus.ACTIVE.value)).all()
        return {env.env_id for env in map(_to_env, rows) if due_slot(env, latest) is not None}

    def held_slots(self) -> list[HeldSlot]:
        """Every slot under a lease now, lapsed or not, by owner (synchronous: an operator's report)."""
        c = rollout_windows.c
        with self._engine.connect() as conn:
            now = self._now_value(conn)
            rows = conn.execute(
                sa.select(rollout_windows)
                .where(c.lease_owner.is_not(None), c.status == EnvStatus.ACTIVE.value)
                .order_by(c.lease_owner, c.env_id)
            ).all()
        out = []
        for row in rows:
            env = _to_env(row)
            slot = 0 if env.window_start is None else env.slots_done
            until = row._mapping["lease_until"]
            out.append(
                HeldSlot(
                    owner=str(row._mapping["lease_owner"]),
                    env_id=env.env_id,
                    slot=slot,
                    expires_in_s=round(float(until) - now, 1) if until is not None else 0.0,
                    attempts=int(row._mapping["attempts"]),
                )
            )
        return out

    async def extend(self, env_id: str, owner: str, lease_s: float) -> bool:
        """Renew ``owner``'s lease on ``env_id`` for ``lease_s`` more; False when it was lost."""
        return await asyncio.to_thread(self._extend, env_id, owner, lease_s)

    def _extend(self, env_id: str, owner: str, lease_s: float) -> bool:
        c = rollout_windows.c
        with self._engine.begin() as conn:
            now = self._now()
            renewed = conn.execute(
                rollout_windows.update()
                .where(c.env_id == env_id, c.lease_owner == owner)
                .values(lease_until=now + lease_s, updated_at=now)
            ).rowcount
        return bool(renewed)

    async def release(
        self, env_id: str, owner: str, *, error: str | None = None, hold_s: float = 0.0, uncount: bool = False
    ) -> None:
        """Give up ``owner``'s lease without progress.

        Args:
            env_id: The env.
            owner: The worker releasing it (another's lease is left alone).
            error: Why the slot failed (kept for the record when it is finally skipped).
            hold_s: Nobody claims it again for this long (back-off after a failure); 0: at once
                (a worker stopping hands its work over).
            uncount: Take back the claim this lease counted (the failure was an outage, not the
                slot's): an outage, however long, never makes a slot look like poison work.
        """
        await asyncio.to_thread(self._release, env_id, owner, error, hold_s, uncount)

    def _release(self, env_id: str, owner: str, error: str | None, hold_s: float, uncount: bool) -> None:
        c = rollout_windows.c
        with self._engine.begin() as conn:
            now = self._now()
            values: dict[str, Any] = {
                "lease_owner": None,
                "lease_until": (now + hold_s) if hold_s > 0 else None,
                "updated_at": now,
            }
            if error is not None:
                values["last_error"] = error[:2000]
            if uncount:
                values["attempts"] = c.attempts - 1  # the lease is owner's, so its claim counted one
            conn.execute(rollout_windows.update().where(c.env_id == env_id, c.lease_owner == owner).values(**values))

    # ---- progress ----------------------------------------------------------------------------------

    async def fix_window(self, env_id: str, start: int, window: int) -> ActiveEnv:
        """Store the env's window as the memory fixed it (the memory's answer is the authority)."""
        return await asyncio.to_thread(self._fix_window, env_id, start, window)

    def _fix_window(self, env_id: str, start: int, window: int) -> ActiveEnv:
        if window < 1:
            raise ValueError(f"env {env_id}'s window must hold at least one slot, the memory answered {window}")
        with self._engine.begin() as conn:
            conn.execute(
                rollout_windows.update()
                .where(rollout_windows.c.env_id == env_id)
                .values(window_start=start, window=window, updated_at=self._now())
            )
        got = self._get(env_id)
        if got is None:
            raise KeyError(f"env {env_id!r} is not in the rollout's active set; register it first")
        return got

    async def done_plays(self, env_id: str, slot: int) -> set[str]:
        """Sample ids of the plays of ``env_id``'s slot that are already published and recorded."""
        return await asyncio.to_thread(self._done_plays, env_id, slot)

    def _done_plays(self, env_id: str, slot: int) -> set[str]:
        c = rollout_plays.c
        with self._engine.connect() as conn:
            return set(conn.execute(sa.select(c.sample_id).where(c.env_id == env_id, c.slot == slot)).scalars())

    async def mark_play_done(self, sample_id: str, env_id: str, slot: int) -> None:
        """Record that a play is published and recorded (idempotent)."""
        await asyncio.to_thread(self._mark_play_done, sample_id, env_id, slot)

    def _mark_play_done(self, sample_id: str, env_id: str, slot: int) -> None:
        with self._engine.begin() as conn:
            conn.execute(
                insert_new(rollout_plays, conn.dialect.name).values(sample_id=sample_id, env_id=env_id, slot=slot)
            )

    async def complete_slot(self, env_id: str, slot: int) -> ActiveEnv:
        """Record that slot ``slot`` is durable, free the lease, and close the window after its last slot.

        Completing a slot that is already done changes nothing (a resumed or taken-over slot).

        Raises:
            KeyError: Unknown env.
        """
        return await asyncio.to_thread(self._advance, env_id, slot, None)

    async def skip_slot(self, env_id: str, slot: int, reason: str) -> ActiveEnv:
        """Give up slot ``slot`` and record why (its plays keep failing); the window goes on."""
        return await asyncio.to_thread(self._advance, env_id, slot, reason)

    def _advance(self, env_id: str, slot: int, skipped: str | None) -> ActiveEnv:
        c = rollout_windows.c
        env = self._get(env_id)
        if env is None:
            raise KeyError(f"env {env_id!r} is not in the rollout's active set; register it first")
        if env.slots_done > slot:
            return env
        updated = env.done(slot)
        values: dict[str, Any] = {
            "slots_done": updated.slots_done,
            "status": (EnvStatus.CLOSED if updated.closed else env.status).value,
            "lease_owner": None,
            "lease_until": None,
            "attempts": 0,
            "last_error": None,
        }
        with self._engine.begin() as conn:
            values["updated_at"] = self._now()
            if skipped is not None:
                values["skipped"] = self._with_skipped(conn, env_id, [SkippedSlot(slot, skipped)])
            current = sa.and_(c.env_id == env_id, c.slots_done == env.slots_done)
            conn.execute(rollout_windows.update().where(current).values(**values))
        got = self._get(env_id)
        assert got is not None
        return got

    def _with_skipped(self, conn: sa.Connection, env_id: str, more: list[SkippedSlot]) -> str:
        raw = conn.execute(sa.select(rollout_windows.c.skipped).where(rollout_windows.c.env_id == env_id)).scalar()
        entries = json.loads(raw or "[]") + [{"slot": s.slot, "reason": s.reason} for s in more]
        return json.dumps(entries)

    async def close_unplayed(self, env_id: str, reason: str) -> ActiveEnv:
        """Close the window, recording every slot not yet played as skipped for ``reason`` (poison work)."""
        return await asyncio.to_thread(self._close_unplayed, env_id, reason)

    def _close_unplayed(self, env_id: str, reason: str) -> ActiveEnv:
        env = self._get(env_id)
        if env is None:
            raise KeyError(f"env {env_id!r} is not in the rollout's active set; register it first")
        if env.status is not EnvStatus.ACTIVE:
            return env
        rest = [SkippedSlot(s, reason) for s in range(env.slots_done, env.window)]
        with self._engine.begin() as conn:
            conn.execute(
                rollout_windows.update()
                .where(rollout_windows.c.env_id == env_id, rollout_windows.c.status == EnvStatus.ACTIVE.value)
                .values(
                    status=EnvStatus.CLOSED.value,
                    slots_done=env.window,
                    skipped=self._with_skipped(conn, env_id, rest),
                    lease_owner=None,
                    lease_until=None,
                    updated_at=self._now(),
                )
            )
        got = self._get(env_id)
        assert got is not None
        return got

    async def mark_retired(self, env_id: str) -> None:
        """The memory knows the window closed: the env leaves the active set for good."""
        await asyncio.to_thread(self._mark_retired, env_id)

    def _mark_retired(self, env_id: str) -> None:
        with self._engine.begin() as conn:
            conn.execute(
                rollout_windows.update()
                .where(rollout_windows.c.env_id == env_id)
                .values(status=EnvStatus.RETIRED.value, lease_owner=None, lease_until=None, updated_at=self._now())
            )
            conn.execute(rollout_plays.delete().where(rollout_plays.c.env_id == env_id))
