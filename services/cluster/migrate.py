"""``spade migrate``: the distributed store's schema, created or upgraded once, under a lock.

In a deployment, the schema is the job of one step that runs before the services (a compose
one-shot service, a Kubernetes Job), never of every replica at start: replicas run with
``SPADE_MEMORY_MIGRATE_ON_START=false``. The step applies the memory's Alembic migrations and
creates the rollout's state tables (they live in the same database, and the rollout's state store
creates its own) while holding the memory's migration lock (a Postgres advisory lock), so two
migrators started at once (a re-run Job, an operator by hand) apply the migrations one after the
other instead of racing on the same DDL. It waits for the database first, so it can start together
with it. A composition root: it is the one place that knows both services' stores.
"""

from __future__ import annotations

import logging

import click

from services.memory.migrate import migration_lock
from spade.dependencies import postgres, wait_for
from spade.serving.logs import configure_from_env, get_logger

logger = get_logger(__name__)


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
