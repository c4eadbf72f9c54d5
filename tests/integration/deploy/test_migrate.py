"""``spade migrate``: the schema once, under a Postgres advisory lock (real Postgres)."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import psycopg
import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from services.cluster.migrate import migrate_command, migrate_database
from services.memory.migrate import MIGRATION_LOCK_KEY, wait_for_schema
from spade.dependencies import DependencyUnavailable
from spade.retry import RetryPolicy

pytestmark = pytest.mark.db

ADMIN = "postgresql://postgres@127.0.0.1:5432/test"


@pytest.fixture
def database() -> Iterator[str]:
    name = f"spade_mig_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(ADMIN, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    finally:
        with psycopg.connect(ADMIN, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def _tables(url: str) -> set[str]:
    engine = sa.create_engine(url)
    try:
        return set(sa.inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_migrate_creates_memory_and_rollout_tables_and_is_idempotent(database: str) -> None:
    result = CliRunner().invoke(migrate_command, ["--database-url", database])
    assert result.exit_code == 0, result.output
    tables = _tables(database)
    assert {"environments", "plays", "alembic_version"} <= tables
    assert any(t.startswith("rollout") for t in tables), tables
    again = CliRunner().invoke(migrate_command, ["--database-url", database])
    assert again.exit_code == 0, again.output


def test_a_second_migrator_waits_for_the_lock(database: str) -> None:
    holder = psycopg.connect(database.replace("+psycopg", ""), autocommit=True)
    holder.execute("SELECT pg_advisory_lock(%s)", (MIGRATION_LOCK_KEY,))
    done = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            migrate_database(database)
        except BaseException as exc:
            errors.append(exc)
        finally:
            done.set()

    worker = threading.Thread(target=run)
    worker.start()
    try:
        # The migrator is seen blocked on our advisory lock in pg_locks (not a timing guess).
        waiting = False
        for _ in range(600):
            row = holder.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted").fetchone()
            if row and row[0] > 0:
                waiting = True
                break
            time.sleep(0.05)
        assert waiting, "the second migrator never queued on the advisory lock"
        assert not done.is_set()
        assert "environments" not in _tables(database)
    finally:
        holder.execute("SELECT pg_advisory_unlock(%s)", (MIGRATION_LOCK_KEY,))
        holder.close()
        worker.join(120)
    assert not errors, errors
    assert "environments" in _tables(database)


def test_a_replica_waits_for_the_schema_that_the_migration_creates(database: str) -> None:
    """The memory started beside the one-shot migration (compose starts both at once) waits for the
    schema instead of failing on a missing table (a compose run crashed there: run_spec does not exist)."""
    policy = RetryPolicy(attempts=3, initial_s=0.05, multiplier=1.0, max_s=0.05, jitter_s=0.0)
    with pytest.raises(DependencyUnavailable, match="not at head yet"):
        wait_for_schema(database, policy)
    migrator = threading.Timer(0.5, migrate_database, args=(database,))
    migrator.start()
    try:
        wait_for_schema(database, RetryPolicy(attempts=200, initial_s=0.1, multiplier=1.0, max_s=0.1, jitter_s=0.0))
    finally:
        migrator.join()
    assert "run_spec" in _tables(database)
