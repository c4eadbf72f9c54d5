"""Services wait for their dependencies (real Postgres, Redis, HTTP and gRPC servers on loopback)."""

from __future__ import annotations

import socket
import threading
from concurrent import futures
from http.server import BaseHTTPRequestHandler, HTTPServer

import grpc as grpc_lib
import pytest

from spade.dependencies import DependencyUnavailable, grpc, http, postgres, redis, tcp, wait_for
from spade.retry import RetryPolicy
from tests.conftest import REDIS_URL

QUICK = RetryPolicy(attempts=2, initial_s=0.0, max_s=0.0, jitter_s=0.0)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again when we return: nothing listens there


@pytest.mark.redis
@pytest.mark.db
def test_real_dependencies_answer() -> None:
    wait_for([postgres("postgresql+psycopg://postgres@127.0.0.1:5432/test"), redis(REDIS_URL)], QUICK)
    assert postgres("sqlite:///x.db") is None


def test_a_missing_dependency_is_named_once_the_tries_are_spent() -> None:
    port = _closed_port()
    with pytest.raises(DependencyUnavailable, match=f"tcp 127.0.0.1:{port}"):
        wait_for([tcp(f"127.0.0.1:{port}")], QUICK)
    with pytest.raises(DependencyUnavailable, match="postgres"):
        wait_for([postgres(f"postgresql+psycopg://spade:hunter2@127.0.0.1:{port}/spade")], QUICK)


def test_credentials_never_appear_in_what_is_logged() -> None:
    dep = postgres("postgresql+psycopg://spade:hunter2@db:5432/spade")
    assert dep is not None and "hunter2" not in dep.describe() and "db:5432" in dep.describe()


def test_http_needs_a_2xx_answer_and_a_server_that_comes_up_late_is_waited_for() -> None:
    status = {"code": 503}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(status["code"])
            self.end_headers()
            status["code"] = 200  # healthy from the second look on

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/health"
        with pytest.raises(DependencyUnavailable, match="HTTP 503"):
            wait_for([http(url)], RetryPolicy(attempts=1))
        wait_for([http(url)], QUICK)
    finally:
        server.shutdown()


@pytest.mark.slow
def test_grpc_channel_ready() -> None:
    server = grpc_lib.server(futures.ThreadPoolExecutor(1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        wait_for([grpc(f"127.0.0.1:{port}")], QUICK)
    finally:
        server.stop(None)
    with pytest.raises(DependencyUnavailable):
        wait_for([grpc(f"127.0.0.1:{_closed_port()}")], RetryPolicy(attempts=1))
