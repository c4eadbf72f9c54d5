"""Builds the memory's object graph from settings: the only place adapters meet the core."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import FastAPI

from services.memory.service import MemoryService
from services.memory.settings import MemorySettings
from services.memory.store.sql import SqlStore, make_engine, migrate


@dataclass
class MemoryApp:
    """The wired service and its REST app (the gRPC server is started by the caller, it needs a loop)."""

    settings: MemorySettings
    service: MemoryService
    rest: FastAPI

    def close(self) -> None:
        """Release the database connections."""
        self.service.store.engine.dispose()


def build_service(settings: MemorySettings) -> MemoryService:
    """The store (migrated when configured) and policy from settings."""
    engine = make_engine(settings.database_url)
    if settings.migrate_on_start:
        migrate(engine)
    return MemoryService(SqlStore(engine, settings.scoring()), settings.policy())


def build(settings: MemorySettings) -> MemoryApp:
    """Everything ``spade serve memory`` runs."""
    from services.memory.rest import create_app

    service = build_service(settings)
    return MemoryApp(settings=settings, service=service, rest=create_app(service, settings))
