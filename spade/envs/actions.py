r"""Action parsing shared by the envs, the rollout and the inference client.

Game actions are ``\boxed{...}`` commands; tool actions are tool calls in one of the forms models
emit. Nothing here raises on model output: malformed input gives ``None`` or an entry in
``ToolCallParse.errors``. Standard library only (copied into the sandbox).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

_BOXED_START = re.compile(r"\\+boxed\s*\{")
_TOOL_CALL_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
_FENCE = re.compile(r"^```[a-zA-Z0-9_-]*\s*\n?(.*?)\n?```$", re.DOTALL)
_EMPTY_FENCE = re.compile(r"```[a-zA-Z0-9_-]*\s*```")
_XML_FUNCTION = re.compile(r"<function=([^>\s]+)\s*>(.*?)(?:</function>|\Z)", re.DOTALL)
_XML_PARAMETER = re.compile(r"<parameter=([^>\s]+)\s*>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.DOTALL)


def _matching_brace(text: str, open_index: int) -> int:
    """Index of the ``}`` closing the ``{`` at ``open_index``, or -1 if it is never closed."""
    depth = 0
    for i in range(open_index, len(text)):
        ch = text[i]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return i
    return -1


def find_boxed(text: str) -> list[str]:
    r"""Contents of every complete top-level ``\boxed{...}`` in ``text``, in order.

    >>> find_boxed(r"\boxed{a} or \boxed{b {c}}")
    ['a', 'b {c}']
    """
    if not isinstance(text, str):
        return []
    found: list[str] = []
    pos = 0
    while True:
        match = _BOXED_START.search(text, pos)
        if match is None:
            return found
        open_index = match.end() - 1
        close = _matching_brace(text, open_index)
        if close < 0:
            pos = match.end()
            continue
        found.append(text[open_index + 1 : close])
        pos = close + 1


def parse_boxed(text: str) -> str | None:
    r"""Content of the last complete ``\boxed{...}`` in ``text`` (nested braces allowed).

    A box nested inside another counts as part of the outer one's content; an unclosed box is
    ignored.

    >>> parse_boxed(r"try \boxed{a} then \boxed{\frac{1}{2}}")
    '\\frac{1}{2}'
    >>> parse_boxed("no box") is None
    True
    """
    boxes = find_boxed(text)
    return boxes[-1] if boxes else None


def normalize_game_action(text: str) -> str:
    r"""The action a game env receives for the agent's reply ``text``.

    The content of the last ``\boxed{...}`` is re-wrapped as ``\boxed{X}`` (stripped); without a
    box the raw text is passed on, stripped.

    >>> normalize_game_action(r"I think... \boxed{ push 3 }")
    '\\boxed{push 3}'
    >>> normalize_game_action("hello")
    'hello'
    """
    boxed = parse_boxed(text)
    if boxed is not None:
        return "\\boxed{" + boxed.strip() + "}"
    return text.strip() if isinstance(text, str) else ""


@dataclass(frozen=True)
class ToolCall:
    """One tool call: the tool's name and its arguments (nested values preserved exactly)."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "arguments": self.arguments}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ToolCall:
        """Build from ``{"name", "arguments"}``; raises ``ValueError`` on anything else."""
        call = _to_call(data)
        if isinstance(call, str):
            raise ValueError(call)
        return call

    def to_text(self) -> str:
        """This call in the ``<tool_call>{json}</tool_call>`` form ``parse_tool_calls`` reads."""
        return "<tool_call>" + json.dumps(self.to_dict(), ensure_ascii=False) + "</tool_call>"


@dataclass(frozen=True)
class ToolCallParse:
    """What ``parse_tool_calls`` found in one reply.

    Attributes:
        calls: well-formed calls, in order.
        errors: one message per malformed call (what was wrong and the expected form).
        content: the reply's text outside the calls, stripped.
    """

    calls: list[ToolCall]
    errors: list[str]
    content: str

    def to_dict(self) -> dict[str, Any]:
        return {"calls": [c.to_dict() for c in self.calls], "errors": list(self.errors), "content": self.content}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ToolCallParse:
        return cls(
            calls=[ToolCall.from_dict(c) for c in data.get("calls", [])],
            errors=[str(e) for e in data.get("errors", [])],
            content=str(data.get("content", "")),
        )


_EXPECTED_FORM = 'expected {"name": "<tool>", "arguments": {...}}'


def _to_call(obj: Any) -> ToolCall | str:
    """A ``ToolCall`` from one decoded JSON value, or an error message."""
    if not isinstance(obj, dict):
        return f"a tool call must be a JSON object, got {type(obj).__name__}; {_EXPECTED_FORM}"
    if isinstance(obj.get("function"), dict):  # OpenAI's {"type": "function", "function": {...}}
        obj = obj["function"]
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return f"tool call without a string 'name' (keys: {sorted(obj)}); {_EXPECTED_FORM}"
    name = name.strip()
    if "arguments" in obj:
        raw = obj["arguments"]
    elif "parameters" in obj:
        raw = obj["parameters"]
    else:
        raw = {}
    if raw is None:
        raw = {}
    if isinstance(raw, str):
        if not raw.strip():
            raw = {}
        else:
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as exc:
                return f"arguments of {name!r} are a string that is not valid JSON ({exc.msg}); {_EXPECTED_FORM}"
    if not isinstance(raw, dict):
        return f"arguments of {name!r} must be a JSON object, got {type(raw).__name__}; {_EXPECTED_FORM}"
    return ToolCall(name=name, arguments=raw)


def _looks_like_call(obj: Any) -> bool:
    if isinstance(obj, dict):
        return "name" in obj or isinstance(obj.get("function"), dict)
    if isinstance(obj, list):
        return bool(obj) and all(_looks_like_call(item) for item in obj)
    return False


def _calls_from_value(value: Any, calls: list[ToolCall], errors: list[str]) -> None:
    for item in value if isinstance(value, list) else [value]:
        call = _to_call(item)
        if isinstance(call, str):
            errors.append(call)
        else:
            calls.append(call)


def _xml_value(raw: str) -> Any:
    text = raw.strip("\n")
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _parse_block(body: str, calls: list[ToolCall], errors: list[str]) -> None:
    """Parse the inside of one ``<tool_call>`` block."""
    text = body.strip()
    fenced = _FENCE.match(text)
    if fenced:
        text = fenced.group(1).strip()
    if not text:
        errors.append(f"empty <tool_call> block; {_EXPECTED_FORM}")
        return
    xml = list(_XML_FUNCTION.finditer(text))
    if xml:  # Qwen3.5-style <function=name><parameter=p>value</parameter></function>
        for match in xml:
            arguments = {p.group(1): _xml_value(p.group(2)) for p in _XML_PARAMETER.finditer(match.group(2))}
            calls.append(ToolCall(name=match.group(1).strip(), arguments=arguments))
        return
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        start = min((i for i in (text.find("{"), text.find("[")) if i >= 0), default=-1)
        try:
            if start < 0:
                raise exc
            value, _ = json.JSONDecoder().raw_decode(text, start)
        except json.JSONDecodeError:
            snippet = text if len(text) <= 80 else text[:77] + "..."
            errors.append(f"<tool_call> block is not valid JSON ({exc.msg}): {snippet!r}; {_EXPECTED_FORM}")
            return
    _calls_from_value(value, calls, errors)


def _parse_bare(text: str, calls: list[ToolCall], errors: list[str]) -> str:
    """Find bare JSON tool calls in ``text``; return the text with them removed."""
    decoder = json.JSONDecoder()
    kept: list[str] = []
    pos = 0
    scan = 0
    while True:
        starts = [i for i in (text.find("{", scan), text.find("[", scan)) if i >= 0]
        if not starts:
            break
        start = min(starts)
        try:
            value, end = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            scan = start + 1
            continue
        if _looks_like_call(value):
            _calls_from_value(value, calls, errors)
            kept.append(text[pos:start])
            pos = end
        scan = end
    kept.append(text[pos:])
    return "".join(kept)


def parse_tool_calls(text: str) -> ToolCallParse:
    """Extract tool calls from a model reply; never raises.

    Accepted forms: ``<tool_call>{json}</tool_call>`` blocks (a missing closing tag is tolerated,
    the JSON may be fenced, and Qwen3.5's ``<function=...><parameter=...>`` form is read too), and
    when there is no such block, bare JSON objects or lists in the text. A call is
    ``{"name", "arguments"}`` (OpenAI's ``{"type": "function", "function": {...}}`` also works),
    with ``arguments`` an object or a JSON string of one (``parameters`` is read as a synonym).
    Nested objects and arrays in arguments are kept exactly.

    >>> p = parse_tool_calls('ok <tool_call>{"name": "f", "arguments": {"a": {"b": [1]}}}</tool_call>')
    >>> p.calls[0].arguments, p.content
    ({'a': {'b': [1]}}, 'ok')
    """
    if not isinstance(text, str):
        return ToolCallParse(calls=[], errors=[f"reply must be text, got {type(text).__name__}"], content="")
    calls: list[ToolCall] = []
    errors: list[str] = []
    if "<tool_call>" in text:
        for match in _TOOL_CALL_BLOCK.finditer(text):
            _parse_block(match.group(1), calls, errors)
        content = _TOOL_CALL_BLOCK.sub(" ", text)
    else:
        content = _parse_bare(text, calls, errors)
    content = _EMPTY_FENCE.sub(" ", content)
    content = re.sub(r"[ \t]+\n", "\n", re.sub(r"[ \t]{2,}", " ", content)).strip()
    return ToolCallParse(calls=calls, errors=errors, content=content)
