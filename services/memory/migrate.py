"""``spade migrate``: the distributed store's schema, created or upgraded once, under a lock.

In a deployment, the schema is the job of one step that runs before the services (a compose
one-shot service, a Kubernetes Job), never of every replica at start: replicas run with
``SPADE_MEMORY_MIGRATE_ON_START=false``. The step applies the memory's Alembic migrations and
creates the rollout's state tables (they live in the same database) while holding a Postgres
advisory lock, so two migrators started at once (a re-run Job, an operator by hand) apply the
migrations one after the other instead of racing on the same DDL. It waits for the database first,
so it can start together with it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import click
import sqlalchemy as sa

from spade.dependencies import DEFAULT_WAIT, DependencyUnavailable, postgres, wait_for
from spade.memory.errors import DatabaseUnavailable
from spade.retry import RetryPolicy
from spade.serving.logs import configure_from_env, get_logger

logger = get_logger(__name__)

#: The Postgres advisory lock every migrator takes (an arbitrary, fixed 64-bit key: "SPADEMIG").
MIGRATION_LOCK_KEY = 0x5350_4144_454D_4947


@contextlib.contextmanager
def migration_lock(engine: sa.Engine) -> Iterator[None]:
    """Hold the migration lock for the duration of the block (a no-op on SQLite, a single-writer file)."""
    if engine.dialect.name != "postgresql":
        yield
        return
    with engine.connect() as conn:
        conn.execute(sa.text("SELECT pg_advisory_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
        try:
            yield
        finally:
            conn.execute(sa.text("SELECT pg_advisory_unlock(:key)"), {"key": MIGRATION_LOCK_KEY})


def migrate_database(memory_url: str, rollout_state_url: str | None = None) -> None:
    """Bring the memory schema to head and create the rollout's state tables, under the lock.

    Args:
        memory_url: SQLAlchemy URL of the memory database.
        rollout_state_url: Where the rollout keeps its active set; default: the memory database.
    """
    from services.memory.store.sql import make_engine, migrate
    from services.rollout.state_store import RolloutStateStore

    engine = make_engine(memory_url)
    try:
        with migration_lock(engine):
            migrate(engine)
            logger.info("memory schema at head")
            if rollout_state_url is None or rollout_state_url == memory_url:
                RolloutStateStore(engine)  # creates its tables when missing
            else:
                RolloutStateStore.from_url(rollout_state_url).dispose()
            logger.info("rollout state tables present")
    finally:
        engine.dispose()


def schema_at_head(engine: sa.Engine) -> bool:
    """Whether the memory's schema is at the newest Alembic revision (what ``spade migrate`` leaves)."""
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory

    from services.memory.store.sql import MIGRATIONS_DIR

    heads = set(ScriptDirectory(str(MIGRATIONS_DIR)).get_heads())
    with engine.connect() as conn:
        return set(MigrationContext.configure(conn).get_current_heads()) == heads


def wait_for_schema(memory_url: str, policy: RetryPolicy = DEFAULT_WAIT) -> None:
    """Block until the schema is at head: a replica started beside the one-shot migration (compose
    starts both at once) must not touch the tables before they exist.

    Raises:
        DependencyUnavailable: Still not at head when the tries were spent (was ``spade migrate`` run?).
    """
    from services.memory.store.sql import make_engine

    engine = make_engine(memory_url)
    try:
        what = "waiting for the memory schema (`spade migrate`)"
        for attempt in policy.retrying(DependencyUnavailable, logger=logger, what=what):
            with attempt:
                try:
                    ready = schema_at_head(engine)
                except (sa.exc.SQLAlchemyError, DatabaseUnavailable) as exc:
                    raise DependencyUnavailable(f"memory schema: {type(exc).__name__}: {exc}") from None
                if not ready:
                    raise DependencyUnavailable("the memory schema is not at head yet: run `spade migrate`")
        logger.info("memory schema at head")
    finally:
        engine.dispose()


@click.command("migrate")
@click.option(
    "--database-url",
    envvar="SPADE_MEMORY_DATABASE_URL",
    required=True,
    help="SQLAlchemy URL of the memory database [env SPADE_MEMORY_DATABASE_URL].",
)
@click.option(
    "--rollout-state-url",
    envvar="SPADE_ROLLOUT_STATE_URL",
    default=None,
    help="The rollout's state database, when not the memory's [env SPADE_ROLLOUT_STATE_URL].",
)
def migrate_command(database_url: str, rollout_state_url: str | None) -> None:
    """Create or upgrade the database schema, once, under a Postgres advisory lock."""
    configure_from_env("migrate", level=logging.INFO, default_format="text")
    wait_for([postgres(database_url), postgres(rollout_state_url or database_url)])
    migrate_database(database_url, rollout_state_url)
    click.echo("schema up to date")
