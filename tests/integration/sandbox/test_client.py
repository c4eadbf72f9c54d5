"""``spade.sandbox.client.SandboxClient`` against the real sandbox service: every API, its errors, its retries."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from services.memory.seed_pool import seed_pool
from services.memory.service import MemoryService
from services.memory.store.sql import SqlStore, make_engine, migrate
from spade.envs import CHECK_NAMES, Outcome, ValidationReport
from spade.envs.examples import EXAMPLES
from spade.queues.inprocess import InProcessQueue
from spade.retry import RetryPolicy
from spade.sandbox import ExecStatus, SandboxFault, SandboxRefused
from spade.sandbox.client import SandboxClient
from spade.v1 import sandbox_pb2, sandbox_pb2_grpc
from tests.integration.sandbox.conftest import ALICE_KEY, COUNTER_ENV, Service

FAST = RetryPolicy(attempts=3, initial_s=0.0, max_s=0.0, jitter_s=0.0)


@pytest.fixture
async def client(sandbox_service: Service) -> AsyncIterator[SandboxClient]:
    async with SandboxClient(sandbox_service.grpc_target, ALICE_KEY, retry=FAST) as c:
        yield c


async def test_validate_answers_the_domain_report(client: SandboxClient) -> None:
    tool = next(e for e in EXAMPLES.values() if e.setting == "tool")
    report = await client.validate(tool.code, "tool")
    assert isinstance(report, ValidationReport)
    assert report.valid and report.env_class and report.repaired_code
    assert [c.name for c in report.checks] == list(CHECK_NAMES)

    broken = await client.validate("class BrokenEnv:\n    def reset(self, seed=None):\n        return 1\n", "game")
    assert not broken.valid and broken.failed, "a failed check is an answer, not an error"


async def test_execute_answers_the_domain_result(client: SandboxClient) -> None:
    result = await client.execute(
        "import sys; print(open('data/in.txt').read() + sys.stdin.read())",
        stdin=b"-b",
        files={"data/in.txt": b"a"},
    )
    assert (result.status, result.exit_code, result.stdout.strip()) == (ExecStatus.OK, 0, b"a-b")
    failed = await client.execute("raise SystemExit(3)")
    assert (failed.status, failed.exit_code) == (ExecStatus.ERROR, 3)


async def test_a_session_plays_on_one_stream(client: SandboxClient) -> None:
    session = await client.open_session(COUNTER_ENV, "game", 9)
    try:
        assert session.initial.outcome is Outcome.OK
        target = int(session.initial.observation.split("exactly ")[1].split(" ")[0])
        for _ in range(target):
            await session.step("\\boxed{go}")
        last = await session.step("\\boxed{stop}")
        assert (last.observation, last.reward, last.terminated) == ("win", 1.0, True)
    finally:
        await session.close()


async def test_a_wrong_key_is_refused_at_once_naming_the_fix(sandbox_service: Service) -> None:
    async with SandboxClient(sandbox_service.grpc_target, "not-the-key", retry=FAST) as bad:
        with pytest.raises(SandboxRefused, match="API key"):
            await bad.validate(COUNTER_ENV, "game")
        with pytest.raises(SandboxRefused, match="refused the session"):
            await bad.open_session(COUNTER_ENV, "game", 1)
        with pytest.raises(SandboxRefused, match="UNAUTHENTICATED"):
            await bad.execute("print(1)")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_an_unreachable_sandbox_is_a_fault_after_every_try() -> None:
    async with SandboxClient(f"127.0.0.1:{_free_port()}", timeout_s=5.0, open_timeout_s=5.0, retry=FAST) as nowhere:
        with pytest.raises(SandboxFault, match="UNAVAILABLE"):
            await nowhere.validate(COUNTER_ENV, "game")
        with pytest.raises(SandboxFault):
            await nowhere.open_session(COUNTER_ENV, "game", 1)


class _Flaky(sandbox_pb2_grpc.SandboxServicer):
    """Forwards to the real sandbox, but answers UNAVAILABLE to the first ``failures`` calls."""

    def __init__(self, target: str, failures: int) -> None:
        self.failures = failures
        self.calls = 0
        self._channel = grpc.aio.insecure_channel(target)
        self._real = sandbox_pb2_grpc.SandboxStub(self._channel)

    async def Validate(  # noqa: N802 - the gRPC method name
        self, request: sandbox_pb2.ValidateRequest, context: Any
    ) -> sandbox_pb2.ValidationReport:
        self.calls += 1
        if self.calls <= self.failures:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "replica draining")
        metadata = tuple((k, v) for k, v in context.invocation_metadata() if k == "authorization")
        report: sandbox_pb2.ValidationReport = await self._real.Validate(request, metadata=metadata)
        return report


@pytest.fixture
async def flaky(sandbox_service: Service) -> AsyncIterator[tuple[_Flaky, str]]:
    servicer = _Flaky(sandbox_service.grpc_target, failures=2)
    server = grpc.aio.server()
    sandbox_pb2_grpc.add_SandboxServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        await server.stop(None)
        await servicer._channel.close(None)


async def test_transient_failures_are_retried_under_the_policy(flaky: tuple[_Flaky, str]) -> None:
    servicer, target = flaky
    game = next(e for e in EXAMPLES.values() if e.setting == "game")
    async with SandboxClient(target, ALICE_KEY, retry=FAST) as c:
        report = await c.validate(game.code, "game")
    assert report.valid and servicer.calls == 3, "two UNAVAILABLE answers, then the real one"

    servicer.calls, servicer.failures = 0, 5
    async with SandboxClient(target, ALICE_KEY, retry=FAST) as c:
        with pytest.raises(SandboxFault, match="replica draining"):
            await c.validate(game.code, "game")
    assert servicer.calls == FAST.attempts, "no more tries than the policy allows"


async def test_the_seed_pool_stores_the_sandbox_s_own_report(client: SandboxClient, tmp_path: Path) -> None:
    """What ``spade envs seed --sandbox`` does: each example validated through the client first."""
    engine = make_engine(f"sqlite:///{tmp_path / 'memory.db'}")
    migrate(engine)
    try:
        memory = MemoryService(SqlStore(engine))
        ids = await seed_pool("game", memory, InProcessQueue(), validate=client.validate, names=["number_hunt"])
        stored = await memory.get_environment(ids[0])
    finally:
        engine.dispose()
    assert stored.env_class and stored.validation_report["valid"] is True
    assert [c["name"] for c in stored.validation_report["checks"]] == list(CHECK_NAMES)
