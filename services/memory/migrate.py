"""The memory schema's migration lock and its "at head" wait, which ``spade migrate`` and the replicas share.

``spade migrate`` itself (``services/cluster/migrate.py``, a composition root: it also creates the
rollout's state tables) holds :func:`migration_lock` while it migrates, so two migrators started at
once apply the migrations one after the other instead of racing on the same DDL; a replica started
beside it (``SPADE_MEMORY_MIGRATE_ON_START=false``) waits in :func:`wait_for_schema`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import sqlalchemy as sa

from spade.dependencies import DEFAULT_WAIT, DependencyUnavailable
from spade.memory.errors import DatabaseUnavailable
from spade.retry import RetryPolicy
from spade.serving.logs import get_logger

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
