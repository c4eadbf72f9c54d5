"""Shared fixtures: the real Postgres and Redis on this machine."""

from __future__ import annotations

import os

POSTGRES_URL = os.environ.get("SPADE_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("SPADE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
