"""The checker over sessions judges exactly as it does in-process, and a session's host answers
nothing outside its protocol.

In the sandbox every episode the checker plays is a session of its own (``spade.envs.remote``);
here each session's host answers through ``LoopbackTransport`` (the same JSON round trip, in this
process), so every verdict the checker reaches must come out as in the in-process run.
"""

from __future__ import annotations

import pytest

from spade.envs.checker import check_env_source
from spade.envs.examples import EXAMPLES
from spade.envs.remote import LoopbackTransport, RemoteSession, SessionHost, loopback_runtime
from spade.envs.session import EnvSession, SessionError
from spade.envs.types import CheckConfig, Outcome, Setting, ValidationReport
from tests.unit.envs.sample_envs import GUESS_GAME, NOTES_TOOL, mutate
from tests.unit.envs.test_checker import DEFECTS

CASES = {
    **{f"example {name}": (e.code, e.setting.value) for name, e in EXAMPLES.items()},
    "sample game": (GUESS_GAME, "game"),
    "sample tool": (NOTES_TOOL, "tool"),
    **{case: (code, setting) for case, (code, setting, _, _) in DEFECTS.items()},
}


def remote_report(code: str, setting: str, config: CheckConfig | None = None) -> ValidationReport:
    runtime = loopback_runtime()
    try:
        return check_env_source(code, setting, config, runtime=runtime)
    finally:
        runtime.close()


def verdicts(report: ValidationReport, sampled: bool = False) -> list[tuple[str, bool]]:
    """Each check's verdict; with ``sampled`` false, not ``random_policy``'s.

    The random policy's seeds and actions are secret draws, so its win count is a sample: for an env
    whose defect is elsewhere (a seed-blind one, say) it can land either side of the limit.
    """
    return [(c.name, c.passed) for c in report.checks if sampled or c.name != "random_policy"]


def sampled(case: str) -> bool:
    """Whether ``case``'s random-policy verdict is all but certain (its defect is a trivially won
    reward); a valid env's, under ~3% true rate, fails by chance about once in 200 validations."""
    return case in DEFECTS and DEFECTS[case][2] == "random_policy"


@pytest.mark.parametrize("case", sorted(CASES))
def test_checking_through_sessions_finds_what_in_process_checking_finds(case: str) -> None:
    code, setting = CASES[case]
    local = check_env_source(code, setting)
    remote = remote_report(code, setting)
    assert remote.env_class == local.env_class
    assert verdicts(remote, sampled(case)) == verdicts(local, sampled(case)), (remote.summary(), local.summary())


def test_every_episode_is_a_fresh_session_that_plays_one_episode() -> None:
    runtime = loopback_runtime()
    report = check_env_source(GUESS_GAME, "game", runtime=runtime)
    assert report.valid, report.summary()
    config = CheckConfig()
    # structure, and at least one session per seed-wise episode and random-policy episode
    assert runtime.sessions_started > config.seed_count * 4 + config.random_policy_episodes
    loaded = runtime.load(GUESS_GAME, Setting.GAME, config)
    assert loaded.ok and loaded.env_class is not None and loaded.env_class.__name__ == "GuessEnv"
    session = runtime.session(loaded.env_class, Setting.GAME, 7, config)
    assert session.reset().outcome is Outcome.OK
    with pytest.raises(SessionError, match="one episode"):
        session.reset()


def test_a_solution_armed_env_fails_replay_on_a_fresh_instance() -> None:
    """An env that wins only once solution() ran on the same instance: no agent can ever win it."""
    code = mutate(GUESS_GAME, "    def solution(self):\n", "    def solution(self):\n        self.armed = True\n")
    code = mutate(
        code,
        "elif int(match.group(1)) == self.secret:",
        "elif int(match.group(1)) == self.secret and getattr(self, 'armed', 0):",
    )
    for report in (check_env_source(code, "game"), remote_report(code, "game")):
        replay = report.check("solution_replay")
        assert not replay.passed and "fresh instance that never had solution() called" in replay.detail, replay


def test_the_host_refuses_attributes_and_ops_outside_the_protocol() -> None:
    host = SessionHost()
    config = CheckConfig().to_dict()
    first = host.handle({"code": GUESS_GAME, "setting": "game", "seed": 3, "config": config})
    assert first["op"] == "outcome" and first["env"]["class"] == "GuessEnv" and first["rng"] is False
    for name in ("__dict__", "secret", "__class__"):
        reply = host.handle({"op": "get", "name": name})
        assert reply["op"] == "raised" and "may not be read" in reply["error"], reply
    assert host.handle({"op": "nothing"})["op"] == "fault"
    solution = host.handle({"op": "solution"})
    assert solution["op"] == "value" and solution["value"][0] == "\\boxed{500}" and solution["rng"] is False


def test_the_host_reports_raw_rewards_and_global_rng_use() -> None:
    code = mutate(GUESS_GAME, "self.turn += 1\n", "self.turn += 1\n        random.random()\n")
    host = SessionHost()
    host.handle({"code": code, "setting": "game", "seed": 3, "config": CheckConfig().to_dict()})
    reply = host.handle({"op": "step", "action": "\\boxed{1}"})
    assert reply["op"] == "outcome" and reply["rng"] is True and set(reply["raw"]) == {"reward", "chars"}


def test_a_memory_error_in_the_host_is_fatal_and_named() -> None:
    code = mutate(GUESS_GAME, "self.turn += 1\n", "self.turn += 1\n        raise MemoryError\n")
    transport = LoopbackTransport(code, Setting.GAME, CheckConfig())
    assert transport.open(0)["op"] == "outcome"
    reply = transport.send({"op": "step", "action": "\\boxed{1}"})
    assert reply["fatal"] is True and reply["outcome"]["outcome"] == Outcome.MEMORY_LIMIT.value
    assert transport.send({"op": "solution"})["op"] == "env_error"  # the process is gone


def test_a_load_failure_is_the_structure_finding() -> None:
    report = remote_report("class NotAnEnvClass:\n    pass\n", "game")
    structure = report.check("structure")
    assert not structure.passed and "no class whose name ends in 'Env'" in structure.detail, structure


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


def test_a_remote_session_is_an_env_session() -> None:
    assert issubclass(RemoteSession, EnvSession)
