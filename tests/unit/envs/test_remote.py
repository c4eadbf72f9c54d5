"""The checker over a host link judges exactly as it does in-process, and the host answers nothing
outside its protocol.

The sandbox runs the checker in one process and the env in another (``spade.envs.remote``); here
the host answers through ``LoopbackLink`` (the same JSON round trip, in this process), so every
finding the checker makes must come out identical to the in-process run.
"""

from __future__ import annotations

import pytest

from spade.envs.checker import check_env_source
from spade.envs.examples import EXAMPLES
from spade.envs.limits import CallTimeout
from spade.envs.remote import EnvHost, HostGone, LoopbackLink, RemoteRuntime
from spade.envs.types import CheckConfig, Setting, ValidationReport
from tests.unit.envs.sample_envs import GUESS_GAME, NOTES_TOOL, mutate
from tests.unit.envs.test_checker import DEFECTS

CASES = {
    **{f"example {name}": (e.code, e.setting.value) for name, e in EXAMPLES.items()},
    "sample game": (GUESS_GAME, "game"),
    "sample tool": (NOTES_TOOL, "tool"),
    **{case: (code, setting) for case, (code, setting, _, _) in DEFECTS.items()},
}


def remote_report(code: str, setting: str, config: CheckConfig | None = None) -> ValidationReport:
    runtime = RemoteRuntime(LoopbackLink)
    try:
        return check_env_source(code, setting, config, runtime=runtime)
    finally:
        runtime.close()


NONDETERMINISTIC = {"determinism: wall clock"}
"""Cases whose findings name whichever step happened to differ: compared by verdict only."""


def findings(report: ValidationReport, details: bool = True) -> list[tuple[str, bool, str]]:
    return [(c.name, c.passed, c.detail if details else "") for c in report.checks]


@pytest.mark.parametrize("case", sorted(CASES))
def test_remote_checking_finds_what_in_process_checking_finds(case: str) -> None:
    code, setting = CASES[case]
    local = check_env_source(code, setting)
    remote = remote_report(code, setting)
    assert (remote.valid, remote.env_class) == (local.valid, local.env_class)
    assert findings(remote, case not in NONDETERMINISTIC) == findings(local, case not in NONDETERMINISTIC)


def test_a_host_that_dies_mid_validation_fails_the_check_and_a_fresh_host_serves_the_next() -> None:
    hosts: list[LoopbackLink] = []

    def connect() -> LoopbackLink:
        hosts.append(LoopbackLink())
        return hosts[-1]

    runtime = RemoteRuntime(connect)
    loaded = runtime.load(GUESS_GAME, Setting.GAME, CheckConfig())
    assert loaded.ok and loaded.env_class is not None
    env = loaded.env_class()
    assert env.reset(seed=1)[0].startswith("Guess my number")
    hosts[-1].close()  # the host's process ends
    with pytest.raises(Exception, match="the host was stopped") as raised:
        env.step("\\boxed{1}")
    assert type(raised.value).__name__ == "EnvProcessDied"
    fresh = loaded.env_class()  # a new instance starts a new host and loads the code again
    assert fresh.reset(seed=1)[0].startswith("Guess my number") and len(hosts) == 2


def test_a_host_timeout_is_a_call_timeout_and_the_host_is_dropped() -> None:
    class SlowLink(LoopbackLink):
        def request(self, message: dict, timeout_s: float) -> dict:
            if message.get("op") == "call":
                from spade.envs.remote import HostTimeout

                raise HostTimeout("no answer")
            return super().request(message, timeout_s)

    runtime = RemoteRuntime(SlowLink)
    env_class = runtime.load(GUESS_GAME, Setting.GAME, CheckConfig()).env_class
    assert env_class is not None
    with pytest.raises(CallTimeout):
        env_class().reset(seed=0)


def test_the_host_refuses_methods_and_attributes_outside_the_protocol() -> None:
    host = EnvHost()
    assert host.handle({"op": "load", "code": GUESS_GAME, "setting": "game"})["class"] == "GuessEnv"
    assert host.handle({"op": "new", "h": 1})["ok"]
    for request in (
        {"op": "call", "h": 1, "method": "__init__", "args": []},
        {"op": "call", "h": 1, "method": "__class__", "args": []},
        {"op": "get", "h": 1, "name": "__dict__"},
        {"op": "get", "h": 1, "name": "secret"},
        {"op": "call", "h": 2, "method": "reset", "args": [0]},
        {"op": "nothing"},
    ):
        reply = host.handle(request)
        assert reply["ok"] is False and reply["kind"] == "raised", (request, reply)


def test_a_memory_error_in_the_host_is_fatal_and_named() -> None:
    code = mutate(GUESS_GAME, "self.turn += 1\n", "self.turn += 1\n        raise MemoryError\n")
    link = LoopbackLink()
    runtime = RemoteRuntime(lambda: link)
    env_class = runtime.load(code, Setting.GAME, CheckConfig()).env_class
    assert env_class is not None
    env = env_class()
    env.reset(seed=0)
    with pytest.raises(Exception, match="memory limit") as raised:
        env.step("\\boxed{1}")
    assert type(raised.value).__name__ == "MemoryError" and link.closed
    with pytest.raises(HostGone):
        link.request({"op": "seed", "n": 1}, 1.0)


def test_solution_longer_than_the_agents_budget_fails_with_the_numbers() -> None:
    budget = CheckConfig(max_turns_cap=1, default_max_turns=1)
    for report in (check_env_source(GUESS_GAME, "game", budget), remote_report(GUESS_GAME, "game", budget)):
        replay = report.check("solution_replay")
        assert not replay.passed
        assert "needs 2 turns; the agent's budget is 1 turns" in replay.detail, replay.detail
        termination = report.check("termination")
        assert termination.passed and "more than the agent's budget of 1 turns: clamped to 1" in termination.detail
    tool = check_env_source(NOTES_TOOL, "tool", CheckConfig(max_turns_cap=2, default_max_turns=2))
    assert "needs 3 turns; the agent's budget is 2 turns" in tool.check("solution_replay").detail
