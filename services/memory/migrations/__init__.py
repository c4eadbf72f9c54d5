"""Alembic migrations of the memory's schema (applied by ``services.memory.store.sql.migrate``)."""
