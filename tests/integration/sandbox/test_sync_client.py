"""``spade.sandbox.sync_client.SyncSandboxClient`` against the real sandbox service, and the agent's turn
budget a caller names (through both clients and REST)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from spade.envs import Outcome
from spade.envs.examples import EXAMPLES
from spade.retry import RetryPolicy
from spade.sandbox import ExecStatus, SandboxRefused
from spade.sandbox.client import SandboxClient
from spade.sandbox.sync_client import SyncSandboxClient
from tests.integration.sandbox.conftest import ALICE_KEY, COUNTER_ENV, Service

FAST = RetryPolicy(attempts=2, initial_s=0.0, max_s=0.0, jitter_s=0.0)
LOOPING = COUNTER_ENV.replace("max_turns = 8", "max_turns = 50")


@pytest.fixture
def client(sandbox_service: Service) -> Iterator[SyncSandboxClient]:
    with SyncSandboxClient(sandbox_service.grpc_target, ALICE_KEY, retry=FAST) as c:
        yield c


def test_validate_execute_and_a_session_without_an_event_loop(client: SyncSandboxClient) -> None:
    example = EXAMPLES["number_hunt"]
    assert client.validate(example.code, "game").valid
    result = client.execute("import sys; print(sys.stdin.read()[::-1])", stdin=b"abc")
    assert (result.status, result.stdout) == (ExecStatus.OK, b"cba\n")
    with client.open_session(COUNTER_ENV, "game", 9) as session:
        target = int(session.initial.observation.split("exactly ")[1].split(" ")[0])
        for _ in range(target):
            session.step("\\boxed{go}")
        assert session.step("\\boxed{stop}").reward == 1.0


def test_a_wrong_key_is_refused_naming_the_fix(sandbox_service: Service) -> None:
    with SyncSandboxClient(sandbox_service.grpc_target, "not-the-key", retry=FAST) as bad:
        with pytest.raises(SandboxRefused, match="API key"):
            bad.execute("print(1)")
        with pytest.raises(SandboxRefused):
            bad.open_session(COUNTER_ENV, "game", 1)


def test_the_agents_budget_caps_validation_and_sessions(client: SyncSandboxClient, sandbox_service: Service) -> None:
    # COUNTER_ENV's solution takes 3-5 turns: within a budget of 8, not of 2.
    assert client.validate(COUNTER_ENV, "game").check("solution_replay").passed
    tight = client.validate(LOOPING, "game", agent_max_turns=2)
    replay = tight.check("solution_replay")
    assert not replay.passed and "the agent's budget is 2 turns" in replay.detail, replay.detail
    assert "more than the agent's budget of 2 turns: clamped to 2" in tight.check("termination").detail
    with client.open_session(LOOPING, "game", 1, agent_max_turns=2) as session:
        assert session.initial.max_turns == 2
        session.step("\\boxed{go}")
        last = session.step("\\boxed{go}")
        assert (last.truncated, last.outcome) == (True, Outcome.LIMIT)
    with httpx.Client(base_url=sandbox_service.http_url, timeout=60) as http:
        body = {"code": LOOPING, "setting": "game", "agent_max_turns": 2}
        rest = http.post("/v1/validate", json=body, headers={"Authorization": f"Bearer {ALICE_KEY}"}).json()
        assert (
            "the agent's budget is 2 turns"
            in next(c for c in rest["checks"] if c["name"] == "solution_replay")["detail"]
        )
        too_many = http.post(
            "/v1/validate", json={**body, "agent_max_turns": 5000}, headers={"Authorization": f"Bearer {ALICE_KEY}"}
        )
        assert too_many.status_code == 422


async def test_the_async_client_names_the_budget_too(sandbox_service: Service) -> None:
    async with SandboxClient(sandbox_service.grpc_target, ALICE_KEY, retry=FAST) as client:
        report = await client.validate(LOOPING, "game", agent_max_turns=2)
        assert "the agent's budget is 2 turns" in report.check("solution_replay").detail
        session = await client.open_session(LOOPING, "game", 1, agent_max_turns=3)
        try:
            assert session.initial.max_turns == 3
        finally:
            await session.close()
