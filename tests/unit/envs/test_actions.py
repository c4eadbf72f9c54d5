"""Action parsing: boxed commands and tool calls in every form models emit."""

from __future__ import annotations

import json

import pytest

from spade.envs.actions import ToolCall, ToolCallParse, find_boxed, normalize_game_action, parse_boxed, parse_tool_calls


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"\boxed{42}", "42"),
        (r"first \boxed{a} then \boxed{b}", "b"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"\boxed{{nested {deep}}}", "{nested {deep}}"),
        (r"\boxed{outer \boxed{inner}}", r"outer \boxed{inner}"),
        (r"\boxed{done} and an unclosed \boxed{oops", "done"),
        (r"\boxed {spaced}", "spaced"),
        (r"\\boxed{double backslash}", "double backslash"),
        (r"\boxed{}", ""),
        ("no box at all", None),
        (r"\boxed{never closed", None),
    ],
)
def test_parse_boxed(text: str, expected: str | None) -> None:
    assert parse_boxed(text) == expected


def test_find_boxed_lists_every_top_level_box() -> None:
    assert find_boxed(r"\boxed{move up} or \boxed{move {left}}") == ["move up", "move {left}"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"I will push. \boxed{ push 3 }", r"\boxed{push 3}"),
        (r"\boxed{a} no wait \boxed{b}", r"\boxed{b}"),
        ("  plain text  ", "plain text"),
        (r"\boxed{\frac{1}{2}}", r"\boxed{\frac{1}{2}}"),
    ],
)
def test_normalize_game_action(text: str, expected: str) -> None:
    assert normalize_game_action(text) == expected


NESTED = {
    "order_id": "O1",
    "shipping": {"method": "express", "address": {"street": "1 Elm", "lines": ["a", {"b": [1, 2.5, None, True]}]}},
    "tags": [],
    "empty": {},
}


def test_tagged_call_keeps_nested_arguments_exactly() -> None:
    """The reference silently turned nested-object arguments into {} (DESIGN §6)."""
    text = "Sure.\n<tool_call>\n" + json.dumps({"name": "update", "arguments": NESTED}) + "\n</tool_call>"
    parsed = parse_tool_calls(text)
    assert parsed.errors == []
    assert parsed.calls == [ToolCall("update", NESTED)]
    assert parsed.content == "Sure."


def test_arguments_as_json_string_keep_nested_values() -> None:
    text = json.dumps({"name": "update", "arguments": json.dumps(NESTED)})
    parsed = parse_tool_calls(f"<tool_call>{text}</tool_call>")
    assert parsed.calls[0].arguments == NESTED


def test_several_tagged_calls_in_order() -> None:
    text = (
        '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call> and '
        '<tool_call>{"name": "b", "arguments": {}}</tool_call>'
    )
    parsed = parse_tool_calls(text)
    assert [c.name for c in parsed.calls] == ["a", "b"]
    assert parsed.content == "and"


def test_bare_object_list_and_openai_wrapper() -> None:
    assert parse_tool_calls('{"name": "f", "arguments": {"k": [1]}}').calls == [ToolCall("f", {"k": [1]})]
    listed = parse_tool_calls('[{"name": "f"}, {"name": "g", "arguments": "{\\"n\\": {\\"m\\": 2}}"}]')
    assert listed.calls == [ToolCall("f", {}), ToolCall("g", {"n": {"m": 2}})]
    wrapped = parse_tool_calls(
        'Calling: {"type": "function", "function": {"name": "h", "arguments": "{\\"q\\": \\"x\\"}"}} now'
    )
    assert wrapped.calls == [ToolCall("h", {"q": "x"})]
    assert wrapped.content == "Calling: now"


def test_parameters_is_read_as_arguments() -> None:
    assert parse_tool_calls('{"name": "f", "parameters": {"a": 1}}').calls == [ToolCall("f", {"a": 1})]


def test_fenced_json_inside_tag_and_unclosed_tag() -> None:
    fenced = parse_tool_calls('<tool_call>\n```json\n{"name": "f", "arguments": {"a": 1}}\n```\n</tool_call>')
    assert fenced.calls == [ToolCall("f", {"a": 1})]
    cut = parse_tool_calls('text <tool_call>{"name": "f", "arguments": {"a": {"b": 2}}}')
    assert cut.calls == [ToolCall("f", {"a": {"b": 2}})]


def test_qwen_xml_form() -> None:
    text = (
        "<tool_call>\n<function=book>\n<parameter=slot>\nS001\n</parameter>\n"
        '<parameter=patient>\n{"name": "Ann", "ids": [1, 2]}\n</parameter>\n</function>\n</tool_call>'
    )
    parsed = parse_tool_calls(text)
    assert parsed.calls == [ToolCall("book", {"slot": "S001", "patient": {"name": "Ann", "ids": [1, 2]}})]


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("<tool_call>{not json}</tool_call>", "not valid JSON"),
        ('<tool_call>{"arguments": {}}</tool_call>', "without a string 'name'"),
        ('<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>', "must be a JSON object"),
        ('<tool_call>{"name": "f", "arguments": "{broken"}</tool_call>', "not valid JSON"),
        ("<tool_call>  </tool_call>", "empty <tool_call>"),
        ('<tool_call>["just", "strings"]</tool_call>', "must be a JSON object"),
    ],
)
def test_malformed_calls_are_reported_not_raised(text: str, fragment: str) -> None:
    parsed = parse_tool_calls(text)
    assert parsed.calls == []
    assert parsed.errors  # one per malformed call
    assert fragment in parsed.errors[0]
    assert '"name"' in parsed.errors[0]  # the message shows the expected form


def test_good_and_bad_calls_together() -> None:
    parsed = parse_tool_calls('<tool_call>{"name": "ok"}</tool_call><tool_call>{oops</tool_call>')
    assert [c.name for c in parsed.calls] == ["ok"]
    assert len(parsed.errors) == 1


def test_plain_text_and_non_call_json_are_content() -> None:
    parsed = parse_tool_calls('The set {1, 2} and the data {"a": 1} are not calls.')
    assert parsed.calls == [] and parsed.errors == []
    assert parsed.content == 'The set {1, 2} and the data {"a": 1} are not calls.'


def test_non_string_reply_is_an_error() -> None:
    parsed = parse_tool_calls(None)  # type: ignore[arg-type]
    assert parsed.calls == [] and parsed.errors


def test_round_trips() -> None:
    call = ToolCall("f", NESTED)
    assert parse_tool_calls(call.to_text()).calls == [call]
    parse = ToolCallParse(calls=[call], errors=["e"], content="c")
    assert ToolCallParse.from_dict(json.loads(json.dumps(parse.to_dict()))) == parse
    with pytest.raises(ValueError, match="name"):
        ToolCall.from_dict({"arguments": {}})
