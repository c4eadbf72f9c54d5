"""Translations at the rollout's edges: sandbox states, tool-step messages, samples."""

from __future__ import annotations

import json

from services.rollout.core.episode import Play, tool_turn_messages
from services.rollout.core.ports import EnvSpec, FinishReason
from services.rollout.core.trajectory import Trajectory
from services.rollout.samples import to_agent_sample, to_play_record
from spade.envs import Outcome, StepOutcome
from spade.sandbox.wire import state_outcome
from spade.v1 import sandbox_pb2


def test_sandbox_states_become_step_outcomes_and_unknown_verdicts_are_faults() -> None:
    state = sandbox_pb2.SessionState(
        observation="o", reward=1.0, terminated=True, info_json=json.dumps({"tools": [1]}), turn=2, outcome="ok"
    )
    got = state_outcome(state)
    assert (got.observation, got.reward, got.terminated, got.info, got.outcome) == (
        "o",
        1.0,
        True,
        {"tools": [1]},
        Outcome.OK,
    )
    assert state_outcome(sandbox_pb2.SessionState(outcome="timeout")).outcome is Outcome.TIMEOUT
    assert state_outcome(sandbox_pb2.SessionState(outcome="exploded")).outcome is Outcome.SANDBOX_FAULT
    assert state_outcome(sandbox_pb2.SessionState(info_json="not json")).info == {}


def _step(info: dict[str, object], observation: str = "obs") -> StepOutcome:
    return StepOutcome(observation, 0.0, False, False, info, 1, 10)


def test_tool_step_messages() -> None:
    results = [
        {"name": "a", "arguments": {}, "output": "1", "ok": True},
        {"name": "b", "arguments": {}, "output": "Error: bad", "ok": False},
    ]
    msgs = tool_turn_messages(_step({"tool_results": results, "errors": ["no name"], "new_instruction": "Next."}))
    assert msgs == [
        {"role": "tool", "name": "a", "content": "1"},
        {"role": "tool", "name": "b", "content": "Error: bad"},
        {"role": "user", "content": "Error: malformed tool call: no name\nNext."},
    ]
    assert tool_turn_messages(_step({"tool_results": [], "errors": ["x"]}, "Error: x")) == [
        {"role": "user", "content": "Error: x"}
    ]


def test_samples_carry_the_actual_oldest_version_and_records_the_window_label() -> None:
    t = Trajectory([1, 2, 3, 4], [0.0, -0.5, 0.0, -0.25], [False, True, False, True], weight_versions=[6, 7])
    play = Play("env", 42, True, t, 1.0, 2, FinishReason.TERMINATED)
    spec = EnvSpec("env", "game", "Optimization", "code", "hint")
    sample = to_agent_sample(play, spec, scheduled=5)
    assert (sample.sample_id, sample.group_id, sample.weight_version) == ("env@v5/hint/42", "env@v5", 6)
    assert list(sample.loss_mask) == t.loss_mask and list(sample.logprobs) == t.logprobs
    assert (sample.finish_reason, sample.hinted, sample.turns, sample.episode_return) == ("terminated", True, 2, 1.0)
    record = to_play_record(play, scheduled=5)
    assert (record.sample_id, record.weight_version) == (sample.sample_id, 5)
