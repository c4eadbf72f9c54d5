"""Store fixtures: every store test runs against a SQLite file and the real Postgres.

Postgres isolation is a schema per test (the migrations run inside it, ``alembic_version`` too) dropped
afterwards; SQLite gets a fresh file.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, create_engine, text

from services.memory.store.sql import make_engine
from spade.memory.records import NewEnvironment
from tests.conftest import POSTGRES_URL


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.db)])
def empty_engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Engine]:
    """An engine on an empty database (nothing migrated)."""
    if request.param == "sqlite":
        engine = make_engine(f"sqlite:///{tmp_path / 'memory.db'}")
        yield engine
        engine.dispose()
        return
    schema = f"t_{uuid.uuid4().hex[:16]}"
    admin = create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(text(f'CREATE SCHEMA "{schema}"'))
    engine = make_engine(POSTGRES_URL, connect_args={"options": f"-csearch_path={schema}"})
    try:
        yield engine
    finally:
        engine.dispose()
        with admin.connect() as c:
            c.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


def env_code(name: str, body: str = "return 1") -> str:
    """A small, distinct environment program."""
    return (
        f"import random\n\n\nclass {name}Env:\n    max_turns = 5\n\n"
        f"    def reset(self, seed=None):\n        self.rng = random.Random(seed)\n        return 'obs', {{}}\n\n"
        f"    def step(self, action):\n        {body}\n\n    def solution(self):\n        return ['a']\n"
    )


def new_env(name: str, *, skill: str = "Logical Deduction", setting: str = "game", **kw: object) -> NewEnvironment:
    return NewEnvironment(setting=setting, skill=skill, code=env_code(name), hint=f"hint for {name}", **kw)  # type: ignore[arg-type]
