"""Translations at the rollout's edges: sandbox states, tool-step messages, samples."""

from __future__ import annotations

import json

from services.rollout.samples import SlotRef, to_agent_sample, to_play_record
from spade.agent.episode import Play, tool_turn_messages
from spade.agent.ports import EnvSpec
from spade.agent.trajectory import Trajectory
from spade.envs import Outcome, StepOutcome
from spade.envs.types import FinishReason
from spade.sandbox.wire import state_outcome
from spade.v1 import sandbox_pb2, types_pb2


def test_sandbox_states_become_step_outcomes_and_unknown_verdicts_are_faults() -> None:
    state = sandbox_pb2.SessionState(
        observation="o",
        reward=1.0,
        terminated=True,
        info_json=json.dumps({"tools": [1]}),
        turn=2,
        outcome=types_pb2.OUTCOME_OK,
    )
    got = state_outcome(state)
    assert (got.observation, got.reward, got.terminated, got.info, got.outcome) == (
        "o",
        1.0,
        True,
        {"tools": [1]},
        Outcome.OK,
    )
    assert state_outcome(sandbox_pb2.SessionState(outcome=types_pb2.OUTCOME_TIMEOUT)).outcome is Outcome.TIMEOUT
    # A verdict this client does not know (a newer sandbox's), or none, is the sandbox's fault.
    assert (
        state_outcome(sandbox_pb2.SessionState(outcome=types_pb2.Outcome.ValueType(99))).outcome
        is Outcome.SANDBOX_FAULT
    )
    assert state_outcome(sandbox_pb2.SessionState()).outcome is Outcome.SANDBOX_FAULT
    assert state_outcome(sandbox_pb2.SessionState(info_json="not json", outcome=types_pb2.OUTCOME_OK)).info == {}


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


def test_samples_and_records_carry_the_window_slot_the_spec_and_the_generating_version() -> None:
    t = Trajectory([1, 2, 3, 4], [0.0, -0.5, 0.0, -0.25], [False, True, False, True], weight_versions=[6, 7])
    play = Play("env", 42, True, t, 1.0, 2, FinishReason.TERMINATED)
    spec = EnvSpec("env", "game", "Optimization", "code", "hint")
    slot = SlotRef(window_start=5, window_index=0, spec_id="abc123")
    sample = to_agent_sample(play, spec, slot)
    assert (sample.sample_id, sample.group_id) == ("env@s0/hint/42", "env@s0")
    # Scored under the env's window slot, whatever version generated it (the learner published 6, 7).
    assert (sample.window_start, sample.window_index, sample.weight_version, sample.spec_id) == (5, 0, 6, "abc123")
    assert list(sample.loss_mask) == t.loss_mask and list(sample.logprobs) == t.logprobs
    assert (sample.finish_reason, sample.hinted, sample.turns, sample.episode_return) == (
        types_pb2.FINISH_REASON_TERMINATED,
        True,
        2,
        1.0,
    )
    record = to_play_record(play, slot)
    assert (record.trajectory_id, record.weight_version, record.window_start, record.window_index, record.spec_id) == (
        sample.sample_id,
        6,
        5,
        0,
        "abc123",
    )
    unplayed = Play("env", 7, False, Trajectory(), 0.0, 0, FinishReason.ENV_ERROR)
    late = SlotRef(window_start=5, window_index=2, spec_id="abc123")
    assert to_play_record(unplayed, late).weight_version == 7  # no model turn: the slot's own version
