"""Waiting for a service's dependencies at start, so that start order never matters.

A service started before its database, queue or peers (compose starts containers together and
podman-compose ignores health conditions; Kubernetes starts pods in any order) waits for each of
them here, retrying under one :class:`~spade.retry.RetryPolicy`, instead of crashing and relying on
a restart policy. Each dependency is a small value naming what it checks::

    wait_for([postgres(settings.database_url), redis(queue.url), grpc("sandbox:50051")])

Only the reachability of each dependency is checked (a connection, a ping, a 2xx answer); what a
service then does with it stays the service's own business.
"""

from __future__ import annotations

import socket
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Literal

from spade.errors import Unavailable
from spade.redact import redact
from spade.retry import RetryPolicy
from spade.serving.logs import get_logger

logger = get_logger(__name__)

#: How long a service waits for its dependencies by default: about five minutes in all.
DEFAULT_WAIT = RetryPolicy(attempts=64, initial_s=0.5, multiplier=1.5, max_s=5.0, jitter_s=0.25)

Kind = Literal["tcp", "postgres", "redis", "http", "grpc"]


class DependencyUnavailable(ConnectionError, Unavailable):
    """A dependency did not answer; the message names it and what was seen."""


@dataclass(frozen=True)
class Dependency:
    """One thing a service needs before it starts: its kind and where it is.

    Attributes:
        kind: How to check it (``tcp`` connect, ``postgres`` query, ``redis`` ping, ``http`` 2xx
            answer, ``grpc`` channel ready).
        target: ``host:port`` (tcp, grpc) or a URL (postgres, redis, http).
        timeout_s: Deadline of one check.
    """

    kind: Kind
    target: str
    timeout_s: float = 3.0

    def describe(self) -> str:
        """The dependency as a person reads it, without credentials."""
        return f"{self.kind} {redact(self.target)}"

    def check(self) -> None:
        """Check once.

        Raises:
            DependencyUnavailable: It did not answer as expected.
        """
        try:
            _CHECKS[self.kind](self)
        except DependencyUnavailable:
            raise
        except Exception as exc:  # every failure of a probe means "not yet"
            raise DependencyUnavailable(f"{self.describe()}: {type(exc).__name__}: {exc}") from None


def tcp(address: str) -> Dependency:
    """A TCP listener at ``host:port``."""
    return Dependency("tcp", address)


def postgres(url: str) -> Dependency | None:
    """A SQL database at a SQLAlchemy URL; ``None`` for SQLite (a local file needs no wait)."""
    return None if url.startswith("sqlite") else Dependency("postgres", url)


def redis(url: str) -> Dependency:
    """A Redis server at ``redis://...``."""
    return Dependency("redis", url)


def http(url: str) -> Dependency:
    """An HTTP endpoint answering 2xx (e.g. ``http://inference:30000/health``)."""
    return Dependency("http", url)


def grpc(target: str) -> Dependency:
    """A gRPC server at ``host:port`` (the channel connects)."""
    return Dependency("grpc", target)


def queue(config: object) -> Dependency | None:
    """The Redis server of a queue configuration (``None`` for the in-process queue)."""
    return redis(str(getattr(config, "url", ""))) if getattr(config, "kind", None) == "redis" else None


def endpoint(config: object) -> Dependency | None:
    """The gRPC server of a service endpoint configuration (``None`` for an in-process variant)."""
    return grpc(str(getattr(config, "target", ""))) if getattr(config, "kind", None) == "grpc" else None


def inference(urls: list[str]) -> list[Dependency | None]:
    """Each inference worker's ``/health`` (answers once its model is loaded)."""
    return [http(url.rstrip("/") + "/health") for url in urls]


def _split_hostport(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{address!r} is not host:port")
    return host.strip("[]"), int(port)


def _check_tcp(dep: Dependency) -> None:
    with socket.create_connection(_split_hostport(dep.target), timeout=dep.timeout_s):
        pass


def _check_postgres(dep: Dependency) -> None:
    import psycopg

    url = dep.target.split("://", 1)
    dsn = "postgresql://" + url[1] if len(url) == 2 else dep.target  # drop SQLAlchemy's +driver
    with psycopg.connect(dsn, connect_timeout=max(1, int(dep.timeout_s))) as conn:
        conn.execute("SELECT 1")


def _check_redis(dep: Dependency) -> None:
    import redis as redis_lib

    client = redis_lib.Redis.from_url(dep.target, socket_connect_timeout=dep.timeout_s, socket_timeout=dep.timeout_s)
    try:
        client.ping()
    finally:
        client.close()


def _check_http(dep: Dependency) -> None:
    try:
        with urllib.request.urlopen(dep.target, timeout=dep.timeout_s) as response:
            status = response.status
    except urllib.error.HTTPError as exc:
        status = exc.code
    if not 200 <= status < 300:
        raise DependencyUnavailable(f"{dep.describe()}: HTTP {status}")


def _check_grpc(dep: Dependency) -> None:
    import grpc as grpc_lib

    channel = grpc_lib.insecure_channel(dep.target)
    try:
        grpc_lib.channel_ready_future(channel).result(timeout=dep.timeout_s)
    finally:
        channel.close()


_CHECKS = {
    "tcp": _check_tcp,
    "postgres": _check_postgres,
    "redis": _check_redis,
    "http": _check_http,
    "grpc": _check_grpc,
}


def wait_for(dependencies: list[Dependency | None], policy: RetryPolicy = DEFAULT_WAIT) -> None:
    """Block until every dependency answers, each retried under ``policy`` (``None`` entries skipped).

    Raises:
        DependencyUnavailable: A dependency still did not answer when the tries were spent; the
            message names it and the last failure.
    """
    for dep in dependencies:
        if dep is None:
            continue
        for attempt in policy.retrying(DependencyUnavailable, logger=logger, what=f"waiting for {dep.describe()}"):
            with attempt:
                dep.check()
        logger.info("dependency ready: %s", dep.describe())
