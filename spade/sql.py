"""Idempotent inserts: the database's own ``INSERT ... ON CONFLICT DO NOTHING``, on SQLite and Postgres.

A row that is already there (a redelivered message, a resumed worker, two writers at once) is left
as it is and the statement succeeds; nothing catches ``IntegrityError``, no transaction is poisoned,
and no pre-select races a concurrent writer. With ``RETURNING`` of the key column, the caller learns
which rows were new:

    new = conn.execute(insert_new(table, conn.dialect.name).values(rows).returning(table.c.key)).scalars()
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.dialects import postgresql, sqlite

_DIALECTS: dict[str, Any] = {"postgresql": postgresql, "sqlite": sqlite}


def insert_new(table: Any, dialect: str) -> Any:
    """``INSERT INTO table ... ON CONFLICT DO NOTHING`` for ``dialect`` (``postgresql`` or ``sqlite``).

    Raises:
        ValueError: Another database (the stores run on these two only).
    """
    module = _DIALECTS.get(dialect)
    if module is None:
        raise ValueError(f"idempotent inserts support postgresql and sqlite, not {dialect!r}")
    return module.insert(table).on_conflict_do_nothing()
