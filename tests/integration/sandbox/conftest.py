"""A real sandbox service (isolated pool + gRPC + REST on loopback ports) for end-to-end tests."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import httpx
import pytest

from services.sandbox.core.auth import hash_key
from services.sandbox.settings import SandboxSettings
from services.sandbox.wiring import serving
from spade.v1 import sandbox_pb2_grpc
from tests.conftest import needs

ALICE_KEY = "alice-secret-key"
BOB_KEY = "bob-secret-key"
WATCH_KEY = "watch-secret-key"
"""A ``read`` key: a monitoring system's (``/healthz/details``, ``/metrics``); it may run nothing."""

# A tiny trusted game: say \boxed{go} as many times as the seed-chosen target, then win.
COUNTER_ENV = """
import random

class CounterEnv:
    max_turns = 8

    def reset(self, seed=None):
        self.rng = random.Random(seed)
        self.target = self.rng.randint(2, 4)
        self.count = 0
        return f"Say \\\\boxed{{go}} exactly {self.target} times, then \\\\boxed{{stop}}.", {}

    def step(self, action):
        if "go" in action:
            self.count += 1
            return f"count={self.count}", 0.0, False, False, {}
        won = self.count == self.target
        return ("win" if won else "lose"), (1.0 if won else 0.0), True, False, {}

    def solution(self):
        return ["\\\\boxed{go}"] * self.target + ["\\\\boxed{stop}"]
"""


@dataclass
class Service:
    grpc_target: str
    http_url: str
    max_request_bytes: int


def _settings() -> SandboxSettings:
    return SandboxSettings(
        grpc={"host": "127.0.0.1", "port": 0},
        http={"host": "127.0.0.1", "port": 0},
        max_request_bytes=512 * 1024,
        api_keys=[
            {"tenant": "alice", "key_sha256": hash_key(ALICE_KEY), "max_sessions": 2, "executions_per_minute": 1000},
            {"tenant": "bob", "key_sha256": hash_key(BOB_KEY), "max_sessions": 1, "executions_per_minute": 2},
            {"tenant": "watch", "key_sha256": hash_key(WATCH_KEY), "role": "read"},
        ],
    )


@contextlib.contextmanager
def running_service(settings: SandboxSettings) -> Iterator[Service]:
    """Run a sandbox service on its own event loop in a thread, as a separate server would."""
    ready: dict[str, Service] = {}
    started = threading.Event()
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    failure: list[BaseException] = []

    async def main() -> None:
        try:
            async with serving(settings) as running:
                ready["svc"] = Service(
                    grpc_target=f"127.0.0.1:{running.grpc_port}",
                    http_url=f"http://127.0.0.1:{running.http_port}",
                    max_request_bytes=settings.max_request_bytes,
                )
                started.set()
                await stop.wait()
        except BaseException as exc:
            failure.append(exc)
            started.set()

    thread = threading.Thread(target=lambda: loop.run_until_complete(main()), daemon=True)
    thread.start()
    started.wait(60)
    if failure:
        raise failure[0]
    try:
        yield ready["svc"]
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)
        with contextlib.suppress(Exception):
            loop.close()


@pytest.fixture(scope="package")
@needs("sandbox")
def sandbox_service() -> Iterator[Service]:
    with running_service(_settings()) as service:
        yield service


MEMORY_BOMB_ENV = COUNTER_ENV.replace(
    '        if "go" in action:\n',
    '        if "bomb" in action:\n'
    "            hog = []\n"
    "            while True:\n"
    "                hog.append(bytes(64 << 20))\n"
    '        if "go" in action:\n',
)
"""``COUNTER_ENV`` that eats memory without limit when told ``\\boxed{bomb}``."""


@pytest.fixture
def http(sandbox_service: Service) -> Iterator[httpx.Client]:
    """A REST client of the package's sandbox service (no key: each test sends its own)."""
    with httpx.Client(base_url=sandbox_service.http_url, timeout=60) as client:
        yield client


@pytest.fixture
def stub(sandbox_service: Service) -> Iterator[sandbox_pb2_grpc.SandboxStub]:
    """A gRPC stub of the package's sandbox service."""
    with grpc.insecure_channel(sandbox_service.grpc_target) as channel:
        yield sandbox_pb2_grpc.SandboxStub(channel)
