"""The run's records beside the environments: every designer attempt, the run spec, sandbox probes.

A part of ``SqlStore`` (it mixes these methods in); each method runs in one transaction. Attempts
are idempotent by sample id, the run spec has one slot (two writers race on its primary key), a
probe of an env replaces the previous one.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from services.memory.store.models import DesignerAttemptRow, EnvironmentRow, EnvProbeRow, RunSpecRow
from services.memory.store.pages import as_utc, check_limit, first_of_each, utc_now
from services.memory.store.pool_stats import POOL_STATUSES
from spade import pool_metrics
from spade.envs.types import Setting
from spade.memory.errors import EnvironmentNotFound, InvalidArgument, RunSpecConflict, RunSpecNotSet
from spade.memory.records import DesignerAttempt, EnvProbe, RecordResult, RunSpecRecord
from spade.memory.runspec import conflict_message
from spade.runspec import RunSpec
from spade.sql import insert_new


class RunRecords:
    """Designer attempts, the run spec and sandbox probes (mixed into ``SqlStore``)."""

    _sessions: sessionmaker[Session]

    # -- designer attempts ----------------------------------------------------------------------

    def record_attempts(self, attempts: Sequence[DesignerAttempt]) -> RecordResult:
        """Store designer attempts, valid or not (idempotent by sample id).

        Raises:
            InvalidArgument: An attempt without a sample id or an outcome, or of an unknown setting.
        """
        for a in attempts:
            if not a.sample_id or not a.outcome:
                raise InvalidArgument(
                    f"designer attempt {a.sample_id!r} needs a sample_id and an outcome (valid, malformed, "
                    f"duplicate or the failing check), got outcome {a.outcome!r}"
                )
            if a.setting not in tuple(Setting):
                raise InvalidArgument(
                    f"designer attempt {a.sample_id!r}: setting {a.setting!r} is not 'game' or 'tool'"
                )
        now = utc_now()
        rows = [
            {
                "sample_id": a.sample_id,
                "setting": a.setting,
                "skill": a.skill,
                "batch_id": a.batch_id,
                "weight_version": a.weight_version,
                "outcome": a.outcome,
                "env_id": a.env_id,
                "spec_id": a.spec_id,
                "created_at": a.created_at or now,
            }
            for a in first_of_each(attempts, lambda a: a.sample_id)
        ]
        if not rows:
            return RecordResult(recorded=0, duplicates=0)
        table = DesignerAttemptRow.__table__
        with self._sessions.begin() as s:
            stmt = insert_new(table, s.get_bind().dialect.name).values(rows).returning(table.c.sample_id)
            recorded = len(s.execute(stmt).scalars().all())
        return RecordResult(recorded=recorded, duplicates=len(attempts) - recorded)

    def attempts(self, batch_id: str | None = None, limit: int = 200) -> list[DesignerAttempt]:
        """Recorded attempts, newest first (of one round when ``batch_id`` is given)."""
        check_limit(limit)
        stmt = select(DesignerAttemptRow)
        if batch_id is not None:
            stmt = stmt.where(DesignerAttemptRow.batch_id == batch_id)
        with self._sessions() as s:
            rows = s.scalars(stmt.order_by(DesignerAttemptRow.seq.desc()).limit(limit)).all()
        return [
            DesignerAttempt(
                sample_id=r.sample_id,
                setting=Setting(r.setting),
                skill=r.skill,
                outcome=r.outcome,
                batch_id=r.batch_id,
                weight_version=r.weight_version,
                env_id=r.env_id,
                spec_id=r.spec_id,
                created_at=as_utc(r.created_at),
            )
            for r in rows
        ]

    # -- the run spec ---------------------------------------------------------------------------

    def get_run_spec(self) -> RunSpecRecord:
        """The stored run spec.

        Raises:
            RunSpecNotSet: None is stored yet.
        """
        with self._sessions() as s:
            row = s.get(RunSpecRow, 1)
            if row is None:
                raise RunSpecNotSet()
            return RunSpecRecord(spec_id=row.spec_id, spec_json=row.spec_json, set_at=as_utc(row.set_at))

    def set_run_spec(self, spec: RunSpec, replace: bool = False) -> RunSpecRecord:
        """Store ``spec`` as the run spec; the same spec again changes nothing.

        Raises:
            RunSpecConflict: A different spec is stored and ``replace`` is false (names each field).
        """
        table = RunSpecRow.__table__
        with self._sessions.begin() as s:
            values = {"slot": 1, "spec_id": spec.spec_id, "spec_json": spec.to_json(), "set_at": utc_now()}
            stmt = insert_new(table, s.get_bind().dialect.name).values(values).returning(table.c.slot)
            if s.execute(stmt).scalar() is None:  # a spec is stored (maybe by a concurrent writer): compare
                row = s.get(RunSpecRow, 1, with_for_update=True)
                assert row is not None, "the insert found slot 1 taken"
                if row.spec_id != spec.spec_id:
                    if not replace:
                        raise RunSpecConflict(conflict_message(RunSpec.from_json(row.spec_json), spec))
                    row.spec_id, row.spec_json, row.set_at = spec.spec_id, spec.to_json(), utc_now()
        return self.get_run_spec()

    # -- sandbox probes (hidden state, first observation, leakage) --------------------------------

    def record_probe(self, probe: EnvProbe) -> None:
        """Keep what a sandboxed reset of the env showed (the latest probe of an env wins).

        Raises:
            EnvironmentNotFound: Unknown id.
        """
        with self._sessions.begin() as s:
            env = s.scalar(select(EnvironmentRow).where(EnvironmentRow.id == probe.env_id))
            if env is None:
                raise EnvironmentNotFound(probe.env_id)
            leaked: bool | None = None
            rule = ""
            if not probe.error and env.setting == Setting.GAME:
                verdict = pool_metrics.leaks_answer(probe.first_observation, probe.solution)
                leaked, rule = verdict.leaked, verdict.rule or ""
            row = s.get(EnvProbeRow, probe.env_id) or EnvProbeRow(env_id=probe.env_id)
            row.first_observation = probe.first_observation
            row.hidden_attributes = dict(probe.hidden_attributes)
            row.solution = list(probe.solution)
            row.error = probe.error[:2000]
            row.hidden_state_size = len(probe.hidden_attributes)
            row.hidden_state_bytes = sum(probe.hidden_attributes.values())
            row.leaked, row.leak_rule, row.probed_at = leaked, rule, utc_now()
            s.add(row)

    def unprobed(self, limit: int = 32) -> list[tuple[str, str, str]]:
        """Pool envs never probed, oldest first: ``(env_id, setting, code)``."""
        stmt = (
            select(EnvironmentRow.id, EnvironmentRow.setting, EnvironmentRow.code)
            .outerjoin(EnvProbeRow, EnvProbeRow.env_id == EnvironmentRow.id)
            .where(EnvProbeRow.env_id.is_(None), EnvironmentRow.status.in_(POOL_STATUSES))
            .order_by(EnvironmentRow.seq)
            .limit(limit)
        )
        with self._sessions() as s:
            return [(str(i), str(st), str(c)) for i, st, c in s.execute(stmt).all()]
