"""The memory while its database does not answer: UNAVAILABLE, never an internal error.

A service waiting for the memory (reading the run spec at start, say) waits through a Postgres
restart only when the memory says it is unavailable; answered INTERNAL, the learner of the chaos test
(``tests/e2e/test_chaos.py``) exited when Postgres restarted while it read the run spec.
"""

from __future__ import annotations

import socket

import psycopg
import pytest
from sqlalchemy import text

from services.memory.grpc_server import grpc_service
from services.memory.service import MemoryService
from services.memory.store.sql import SqlStore, make_engine
from spade.auth import KeyRing, Principal, Role, hash_key
from spade.errors import ErrorKind
from spade.memory.client import MemoryClient
from spade.memory.errors import DatabaseUnavailable, MemoryUnavailable
from spade.memory.runspec import fetch_run_spec
from spade.serving.grpc import grpc_server
from spade.serving.settings import ServerAddress
from tests.conftest import POSTGRES_URL

KEY = "memory-test-key"


def _nobody_listening() -> str:
    """A Postgres URL on a port of this machine where no server listens."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"postgresql+psycopg://postgres@127.0.0.1:{port}/memory"


def test_a_database_that_does_not_answer_is_unavailable() -> None:
    store = SqlStore(make_engine(_nobody_listening()))
    with pytest.raises(DatabaseUnavailable, match="down or restarting") as caught:
        store.get_run_spec()
    assert caught.value.kind is ErrorKind.UNAVAILABLE


@pytest.mark.db
def test_a_dropped_connection_is_unavailable_and_the_next_call_reconnects() -> None:
    engine = make_engine(POSTGRES_URL)
    try:
        with engine.connect() as conn:
            pid = conn.execute(text("SELECT pg_backend_pid()")).scalar()
            with psycopg.connect(POSTGRES_URL.replace("+psycopg", ""), autocommit=True) as admin:
                admin.execute("SELECT pg_terminate_backend(%s)", (pid,))  # as a restart ends it
            with pytest.raises(DatabaseUnavailable, match="AdminShutdown"):
                conn.execute(text("SELECT 1"))
        with engine.connect() as conn:
            assert conn.execute(text("SELECT 1")).scalar() == 1
    finally:
        engine.dispose()


async def test_a_service_reading_the_run_spec_keeps_waiting_while_the_database_is_down() -> None:
    service = MemoryService(SqlStore(make_engine(_nobody_listening())))
    keys = KeyRing({hash_key(KEY): Principal("learner", Role.WRITE)})
    async with grpc_server(
        [grpc_service(service)], ServerAddress(port=0), service="memory", authenticate=keys.authenticate
    ) as running:
        client = MemoryClient(f"127.0.0.1:{running.port}", timeout_s=20, api_key=KEY)
        try:
            with pytest.raises(MemoryUnavailable, match="UNAVAILABLE: the memory's database did not answer"):
                await client.get_run_spec()
            # It waited the whole second (an internal error would have ended the wait at once).
            with pytest.raises(TimeoutError, match="not reachable within 1 s"):
                await fetch_run_spec(client, service="learner", poll_s=0.05, timeout_s=1.0)
        finally:
            await client.close()
