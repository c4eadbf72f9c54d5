"""Rollout state stores on the real databases: a SQLite file and Postgres (a schema per test)."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from services.rollout.policy import FormatterTemplate
from spade.inference.chat import ChatFormatter
from tests.conftest import POSTGRES_URL, needs


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.db)])
def state_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A database URL for the rollout's state tables, empty, on each backend."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'rollout.db'}"
        return
    with postgres_schema() as url:
        yield url


@pytest.fixture
@needs("db")
def postgres_url() -> Iterator[str]:
    """A Postgres URL for the rollout's state tables, in a schema of the test's own."""
    with postgres_schema() as url:
        yield url


@contextlib.contextmanager
def postgres_schema() -> Iterator[str]:
    """A fresh schema on the test Postgres, as a URL whose search path is that schema; dropped afterwards."""
    schema = f"rollout_test_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(POSTGRES_URL)
    try:
        with admin.begin() as conn:
            conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    except sa.exc.OperationalError as exc:  # pragma: no cover - the machine has Postgres
        pytest.fail(f"Postgres at {POSTGRES_URL} is required for this test: {exc}")
    sep = "&" if "?" in POSTGRES_URL else "?"
    try:
        yield f"{POSTGRES_URL}{sep}options=-csearch_path%3D{schema}"
    finally:
        with admin.begin() as conn:
            conn.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


@pytest.fixture(scope="session")
@needs("model")
def template() -> FormatterTemplate:
    """The real policy tokenizer and chat template (SmolLM2, converted once, offline)."""
    from spade.inference.models import ensure_default_model

    return FormatterTemplate(ChatFormatter.from_pretrained(ensure_default_model()))
