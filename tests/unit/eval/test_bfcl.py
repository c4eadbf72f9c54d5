"""The BFCL multi-turn suite without a model: BFCL's checker, our driver and parser, and safety."""

from __future__ import annotations

import ast
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from services.eval.core.ports import Reply
from services.eval.suites.bfcl import BfclMultiTurnSuite, safe_call_problem
from spade.envs.actions import ToolCall, parse_tool_calls


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory) -> BfclMultiTurnSuite:
    return BfclMultiTurnSuite(None, 0, tmp_path_factory.mktemp("bfcl"), items_per_category=3)


def _as_tool_call(call: str, functions: Sequence[Mapping[str, Any]]) -> ToolCall:
    """A ground-truth call string (``mv(source='a', destination='b')``) as a tool call."""
    node = ast.parse(call, mode="eval").body
    assert isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    doc = next(f for f in functions if f["name"] == node.func.id)
    names = list(doc["parameters"]["properties"])
    arguments = {names[i]: ast.literal_eval(a) for i, a in enumerate(node.args)}
    arguments.update({k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg})
    return ToolCall(node.func.id, arguments)


class GoldModel:
    """Replies with each turn's ground-truth calls as <tool_call> blocks, then ends the turn."""

    def __init__(self, truth: list[list[str]], functions: Sequence[Mapping[str, Any]]) -> None:
        self.truth = truth
        self.functions = list(functions)
        self.turn = 0
        self.called = False
        self.seen_tools: list[set[str]] = []

    async def reply(
        self, messages: Sequence[Mapping[str, Any]], *, tools: Any = None, key: str, turn: int = 0
    ) -> Reply:
        self.seen_tools.append({t["function"]["name"] for t in tools or []})
        if self.called:  # the calls of this turn are done: say so and end the turn
            self.called = False
            self.turn += 1
            text = "Done."
        else:
            calls = [_as_tool_call(c, [*self.functions, *_holdouts(key)]) for c in self.truth[self.turn]]
            if not calls:
                self.turn += 1
                text = "I cannot do that with the functions I have."
            else:
                self.called = True
                text = "\n".join(c.to_text() for c in calls)
        return Reply(text=text, tool_calls=parse_tool_calls(text))


_HOLDOUTS: dict[str, list[dict[str, Any]]] = {}


def _holdouts(entry_id: str) -> list[dict[str, Any]]:
    return _HOLDOUTS.get(entry_id, [])


@pytest.mark.slow
async def test_the_gold_calls_score_1_and_no_calls_score_0(suite: BfclMultiTurnSuite) -> None:
    for item in suite.items():
        truth = suite.ground_truth(item.id)
        assert suite.score(item.id, [[turn] if turn else [] for turn in truth]) == (1.0, "")
        score, why = suite.score(item.id, [[] for _ in truth])
        assert score == 0.0 and why


def test_a_wrong_call_fails_bfcl_s_state_check(suite: BfclMultiTurnSuite) -> None:
    item = next(i for i in suite.items() if i.category == "multi_turn_base")
    truth = suite.ground_truth(item.id)
    wrong = [[["cd(folder='nowhere')"]] for _ in truth]
    score, why = suite.score(item.id, wrong)
    assert score == 0.0 and why.startswith("multi_turn:")


def test_a_cut_short_conversation_fails(suite: BfclMultiTurnSuite) -> None:
    item = suite.items()[0]
    truth = suite.ground_truth(item.id)
    assert suite.score(item.id, [[t] for t in truth[:-1]])[0] == 0.0
    assert suite.score(item.id, [[t] for t in truth], forced_quit=True)[0] == 0.0


@pytest.mark.parametrize("category", ["multi_turn_base", "multi_turn_miss_func", "multi_turn_miss_param"])
async def test_a_perfect_agent_scores_1_through_our_driver_and_parser(suite: BfclMultiTurnSuite, category: str) -> None:
    item = next(i for i in suite.items() if i.category == category)
    entry = suite.entry(item.id)
    _HOLDOUTS[item.id] = [f for fs in entry.get("missed_function", {}).values() for f in fs]
    model = GoldModel(suite.ground_truth(item.id), entry["function"])
    talk = await suite.converse(entry, category, model)
    assert not talk.forced_quit and talk.error == ""
    assert suite.score(item.id, talk.decoded) == (1.0, "")
    if category == "multi_turn_miss_func":  # the held-out function is offered only from its turn on
        held = {f["name"] for f in _HOLDOUTS[item.id]}
        assert not held & model.seen_tools[0] and held <= model.seen_tools[-1]


async def test_the_step_limit_force_terminates(tmp_path: Path) -> None:
    limited = BfclMultiTurnSuite(None, 0, tmp_path, ["multi_turn_base"], items_per_category=1, max_steps=2)
    entry = limited.entry(limited.items()[0].id)

    class Looping:
        async def reply(self, messages: Any, *, tools: Any = None, key: str, turn: int = 0) -> Reply:
            text = ToolCall("pwd", {}).to_text()
            return Reply(text=text, tool_calls=parse_tool_calls(text))

    talk = await limited.converse(entry, "multi_turn_base", Looping())
    assert talk.forced_quit and "force-terminated after 2 steps" in talk.error


def test_only_offered_tools_with_identifier_arguments_are_executed() -> None:
    offered = {"ls", "cd"}
    assert safe_call_problem(ToolCall("ls", {"a": True}), offered) is None
    assert "unknown function" in str(safe_call_problem(ToolCall("__import__('os').system", {}), offered))
    assert "not an identifier" in str(safe_call_problem(ToolCall("cd", {"folder=print(1),x": "a"}), offered))
    assert "not an identifier" in str(safe_call_problem(ToolCall("cd", {"lambda": "a"}), offered))


async def test_model_output_never_runs_as_code(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    payload = f"__import__('os').makedirs({str(marker)!r})"
    attacks = [
        {"name": "cd", "arguments": {f"folder='x',_={payload},y": 1}},  # code in an argument name
        {"name": f"cd(folder={payload})#", "arguments": {}},  # code in the function name
        {"name": "cd", "arguments": {"folder": payload}},  # code as a value: only ever a string literal
    ]
    whole = BfclMultiTurnSuite(None, 0, tmp_path, ["multi_turn_base"])
    item = next(i for i in whole.items() if "cd" in {f["name"] for f in whole.entry(i.id)["function"]})
    entry = whole.entry(item.id)

    class Attacker:
        def __init__(self) -> None:
            self.sent = False
            self.tool_messages: list[str] = []

        async def reply(self, messages: Any, *, tools: Any = None, key: str, turn: int = 0) -> Reply:
            self.tool_messages += [m["content"] for m in messages if m["role"] == "tool"]
            text = "" if self.sent else "".join(f"<tool_call>{json.dumps(a)}</tool_call>" for a in attacks)
            self.sent = True
            return Reply(text=text, tool_calls=parse_tool_calls(text))

    attacker = Attacker()
    talk = await whole.converse(entry, item.category, attacker)
    whole.score(item.id, talk.decoded)
    assert not marker.exists()
    executed = [call for turn in talk.decoded for step in turn for call in step]
    assert executed == [f"cd(folder={payload!r})"]  # only the string-valued call, as a literal
    assert sum("Error during execution" in m for m in attacker.tool_messages) >= 2
    # The attack is real: BFCL's own converter and executor, unguarded, do run it.
    raw = whole.bfcl.handler_utils.convert_to_function_call([{"cd": attacks[0]["arguments"]}])
    whole._execute(raw, entry, item.category)
    whole._forget(item.id)
    assert marker.exists(), "the attack did not reach BFCL's eval, so this test proved nothing"


async def test_executor_instances_are_removed_after_scoring(suite: BfclMultiTurnSuite) -> None:
    from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils

    item = suite.items()[1]
    entry = suite.entry(item.id)
    talk = await suite.converse(entry, item.category, GoldModel(suite.ground_truth(item.id), entry["function"]))
    assert any(k.startswith(suite.model_name) for k in vars(multi_turn_utils))
    suite.score(item.id, talk.decoded)
    suite._forget(item.id)
    assert not any(k.startswith(suite.model_name) for k in vars(multi_turn_utils))


@pytest.mark.slow
def test_each_suite_has_its_own_model_name_and_a_seeded_order(tmp_path: Path) -> None:
    a = BfclMultiTurnSuite(None, 0, tmp_path, items_per_category=2)
    b = BfclMultiTurnSuite(None, 0, tmp_path, items_per_category=2)
    c = BfclMultiTurnSuite(None, 1, tmp_path, items_per_category=2)
    assert a.model_name != b.model_name
    assert [i.id for i in a.items()] == [i.id for i in b.items()] != [i.id for i in c.items()]
    assert [i.category for i in a.items()[:4]] == list(a.categories)


def test_unknown_categories_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown BFCL multi-turn categories"):
        BfclMultiTurnSuite(None, 0, tmp_path, ["simple"])
