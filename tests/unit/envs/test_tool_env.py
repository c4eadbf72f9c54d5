"""ToolEnv semantics: advance only on a flip, clear errors, never a crash."""

from __future__ import annotations

import json

import pytest

from spade.envs.actions import ToolCall
from spade.envs.loader import load_env_class
from tests.unit.envs.sample_envs import NOTES_TOOL, mutate


def make(code: str = NOTES_TOOL, seed: int = 0):
    loaded = load_env_class(code, "tool")
    assert loaded.ok, loaded.problems
    assert loaded.env_class is not None
    env = loaded.env_class()
    observation, info = env.reset(seed=seed)
    return env, observation, info


def call(name: str, **arguments) -> str:
    return ToolCall(name, arguments).to_text()


def add_a(env) -> str:
    return call("add_note", title=env.a, body="draft", meta={"tags": ["work"]})


def test_reset_returns_first_instruction_and_tools() -> None:
    env, observation, info = make()
    assert observation == env.instructions[0] == info["instruction"]
    assert info["instruction_index"] == 0 and info["num_instructions"] == 3
    names = [t["function"]["name"] for t in info["tools"]]
    assert names == ["add_note", "delete_note", "search", "get_time"]
    assert all(t["type"] == "function" and "parameters" in t["function"] for t in info["tools"])
    json.dumps(info)  # crosses the sandbox boundary as JSON


def test_completing_call_advances_and_announces_the_next_instruction() -> None:
    env, _, _ = make()
    observation, reward, terminated, truncated, info = env.step(add_a(env))
    assert env.current == 1
    assert info["new_instruction"] == env.instructions[1]
    assert env.instructions[1] in observation
    assert (reward, terminated, truncated) == (0.0, False, False)
    assert info["tool_results"] == [
        {
            "name": "add_note",
            "arguments": {"title": env.a, "body": "draft", "meta": {"tags": ["work"]}},
            "output": f"Saved {env.a}.",
            "ok": True,
        }
    ]


def test_unrelated_and_unchanged_calls_do_not_advance() -> None:
    env, _, _ = make()
    for action in (call("get_time"), call("search", query="x"), call("delete_note", title="nope")):
        _, _, _, _, info = env.step(action)
        assert env.current == 0
        assert "new_instruction" not in info


def test_criterion_already_true_does_not_advance() -> None:
    """A criterion true before the call is not a flip: the reference advanced on any call."""
    code = mutate(
        NOTES_TOOL,
        '{c: {"body": "old", "meta": {"tags": ["home"]}}}',
        '{c: {"body": "old", "meta": {"tags": ["home"]}}, a: {"body": "draft", "meta": {"tags": ["work"]}}}',
    )
    env, _, _ = make(code)
    assert env.criterion_holds(0)
    env.step(call("get_time"))
    env.step(add_a(env))  # leaves the (already true) criterion true: still no flip
    assert env.current == 0


def test_only_the_current_instruction_can_advance() -> None:
    env, _, _ = make()
    env.step(call("delete_note", title=env.c))  # completes instruction 3's criterion early
    assert env.current == 0
    env.step(add_a(env))
    env.step(call("add_note", title=env.b, body="final", meta={"tags": ["home"], "pinned": True}))
    assert env.current == 2
    # Instruction 3's criterion is already true, so it can never flip: the episode cannot finish.
    _, reward, terminated, _, _ = env.step(call("delete_note", title=env.c))
    assert env.current == 2 and reward == 0.0 and not terminated


def test_full_solution_returns_one_and_terminates() -> None:
    env, _, _ = make()
    outcome = None
    for block in env.solution_calls():
        for c in block:
            outcome = env.step(c.to_text())
    assert outcome is not None
    observation, reward, terminated, truncated, _ = outcome
    assert (reward, terminated, truncated) == (1.0, True, False)
    assert "ALL INSTRUCTIONS COMPLETE" in observation
    with pytest.raises(RuntimeError, match="episode is over"):
        env.step(call("get_time"))


def test_several_calls_in_one_message_each_count() -> None:
    env, _, _ = make()
    both = add_a(env) + call("add_note", title=env.b, body="final", meta={"tags": ["home"], "pinned": True})
    _, _, _, _, info = env.step(both)
    assert env.current == 2 and len(info["tool_results"]) == 2
    assert info["new_instruction"] == env.instructions[2]


@pytest.mark.parametrize(
    ("action", "fragment"),
    [
        ("<tool_call>{broken json</tool_call>", "malformed tool call"),
        (call("launch_rockets"), "unknown tool 'launch_rockets'"),
        (call("add_note", title="t", body="b"), "missing required argument 'meta'"),
        (call("add_note", title=1, body="b", meta={"tags": []}), "argument 'title' must be string"),
        (call("add_note", title="t", body="b", meta={"tags": ["play"]}), "must be one of ['work', 'home']"),
        (call("add_note", title="t", body="b", meta={"tags": "work"}), "argument 'meta'.tags must be array"),
        (call("add_note", title="t", body="b", meta={"tags": []}, color="red"), "unknown argument 'color'"),
        (call("delete_note", title="ghost"), "delete_note failed: KeyError"),
    ],
)
def test_bad_calls_give_an_error_observation_not_a_crash(action: str, fragment: str) -> None:
    env, _, _ = make()
    observation, reward, terminated, truncated, _ = env.step(action)
    assert "Error" in observation and fragment in observation
    assert (reward, terminated, truncated) == (0.0, False, False)
    assert env.current == 0


def test_plain_reply_restates_the_open_request() -> None:
    env, _, _ = make()
    observation, *_ = env.step("I'd be happy to help!")
    assert "No tool call found" in observation and env.instructions[0] in observation


def test_turn_limit_truncates() -> None:
    env, _, _ = make()
    results = [env.step(call("get_time")) for _ in range(env.max_turns)]
    assert [r[3] for r in results] == [False] * (env.max_turns - 1) + [True]


def test_step_before_reset_raises() -> None:
    loaded = load_env_class(NOTES_TOOL, "tool")
    assert loaded.env_class is not None
    with pytest.raises(RuntimeError, match="before reset"):
        loaded.env_class().step("hi")


def test_declaration_problems_name_the_fix() -> None:
    bad_schema = mutate(NOTES_TOOL, '"required": ["title", "body", "meta"]', '"required": ["title", "color"]')
    assert any("required must list names from properties" in p for p in load_env_class(bad_schema, "tool").problems)
    no_method = mutate(NOTES_TOOL, "def tool_get_time(self):", "def get_time(self):")
    assert any("no method tool_get_time" in p for p in load_env_class(no_method, "tool").problems)
    bad_signature = mutate(NOTES_TOOL, "def tool_search(self, query):", "def tool_search(self, q):")
    assert any("does not accept parameter 'query'" in p for p in load_env_class(bad_signature, "tool").problems)
    bad_type = mutate(NOTES_TOOL, '"body": {"type": "string"}', '"body": {"type": "text"}')
    assert any("type 'text'" in p for p in load_env_class(bad_type, "tool").problems)
