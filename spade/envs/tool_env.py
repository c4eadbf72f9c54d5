r"""``ToolEnv``: the base class of tool-setting envs, which owns ``reset()``/``step()``.

A subclass (what the designer writes) declares:

- ``tools``: a list of OpenAI function schemas, each ``{"name", "description", "parameters"}``
  (the ``{"type": "function", "function": {...}}`` wrapper is accepted too); nested object and
  array parameters and ``enum`` are allowed;
- one method ``tool_<name>(self, **arguments) -> str`` per tool (a non-string result is sent as
  JSON; an exception becomes an error message to the agent, which can recover from it);
- ``setup(self, rng)``: builds the backend ``self.state`` and sets ``self.instructions`` (3–5
  user requests) and ``self.criteria`` (one ``criterion(state) -> bool`` per instruction) using
  only ``rng`` (a ``random.Random`` seeded by ``reset``) for randomness;
- ``solution(self)``: per instruction, the list of calls ``{"name", "arguments"}`` that complete
  it on the instance built by the last reset;
- optionally ``max_turns`` (default 20).

What ``reset(seed)`` returns: the first instruction as the observation, and an info dict with
``tools`` (``tools_openai()``), ``instruction`` (the same text), ``instruction_index`` (0) and
``num_instructions``.

What ``step(action)`` does: parses the tool calls in ``action`` (any form ``parse_tool_calls``
reads) and runs them in order. The current instruction advances only when *this* call flips its
criterion from False to True; a criterion that was already true, or a call that leaves it
unchanged, does not advance it. On advancing, the next instruction is the new user turn: it is
appended to the observation and put in ``info["new_instruction"]``. Reward is 1.0 (terminated)
when the last instruction completes, else 0.0. Malformed calls, unknown tools and arguments that
break the schema give an error observation, never an exception. Per-call details are in
``info["tool_results"]`` (``name``, ``arguments``, ``output``, ``ok``), so a chat rollout can send
tool outputs as ``tool`` messages and ``new_instruction`` as a ``user`` message.

Standard library only (copied into the sandbox).
"""

from __future__ import annotations

import inspect
import json
import random
from collections.abc import Callable
from typing import Any, ClassVar

from spade.envs.actions import ToolCall, parse_tool_calls
from spade.envs.schema import tool_problems, validate_arguments

_KEYWORD = inspect.Parameter.POSITIONAL_OR_KEYWORD
MIN_INSTRUCTIONS = 3
MAX_INSTRUCTIONS = 5


def normalize_tool(declaration: Any) -> dict[str, Any]:
    """``{"name", "description", "parameters"}`` from either accepted declaration form."""
    if not isinstance(declaration, dict):
        raise ValueError(f"a tool declaration must be a dict, got {type(declaration).__name__}")
    inner = declaration.get("function") if declaration.get("type") == "function" else declaration
    if not isinstance(inner, dict):
        raise ValueError("a {'type': 'function'} tool declaration needs a 'function' object")
    return {
        "name": inner.get("name"),
        "description": inner.get("description", ""),
        "parameters": inner.get("parameters", {"type": "object", "properties": {}}),
    }


def as_tool_call(call: Any) -> ToolCall:
    """A ``ToolCall`` from a ``ToolCall``, a ``{"name", "arguments"}`` dict or a ``(name, args)`` pair."""
    if isinstance(call, ToolCall):
        return call
    if isinstance(call, tuple | list) and len(call) == 2 and isinstance(call[0], str):
        return ToolCall.from_dict({"name": call[0], "arguments": call[1]})
    if isinstance(call, dict):
        return ToolCall.from_dict(call)
    raise ValueError(f'a solution call must be {{"name": ..., "arguments": {{...}}}}, got {call!r:.80}')


def _signature_problems(name: str, method: Any, parameters: dict[str, Any]) -> list[str]:
    """Mismatches between a tool method's signature and its parameter schema."""
    try:
        signature = inspect.signature(method)
    except (TypeError, ValueError):
        return []
    params = [p for p in signature.parameters.values() if p.name != "self"]
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return []
    named = {p.name: p for p in params if p.kind in (_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}
    required = set(parameters.get("required") or [])
    problems = [
        f"tool_{name}() does not accept parameter {prop!r} declared in its schema"
        for prop in parameters.get("properties") or {}
        if prop not in named
    ]
    problems += [
        f"tool_{name}() parameter {p.name!r} has no default but the schema does not require it; "
        "add it to 'required' or give it a default"
        for p in named.values()
        if p.default is inspect.Parameter.empty and p.name not in required
    ]
    return problems


class ToolEnv:
    """Base class of tool envs; see the module docstring for the contract.

    Attributes:
        tools: OpenAI function schemas of the tools (class attribute of the subclass).
        max_turns: turn limit; the episode is truncated when it is reached.
        state: the backend state the tools read and write (built by ``setup``).
        instructions: the user requests, in order.
        criteria: one ``criterion(state) -> bool`` per instruction.
        rng: the ``random.Random(seed)`` of the current episode.
        turn: steps taken in this episode.
        current: index of the instruction being worked on (== len(instructions) when all done).
    """

    tools: ClassVar[list[dict[str, Any]]] = []
    max_turns: int = 20

    def __init__(self) -> None:
        self.state: Any = {}
        self.instructions: list[str] = []
        self.criteria: list[Callable[[Any], bool]] = []
        self.rng = random.Random(0)
        self.turn = 0
        self.current = 0
        self.criterion_errors: dict[int, str] = {}

    # --- what subclasses implement -------------------------------------------------------
    def setup(self, rng: random.Random) -> None:
        """Build ``self.state``, ``self.instructions`` and ``self.criteria`` from ``rng`` only."""
        raise NotImplementedError(f"{type(self).__name__} must implement setup(self, rng)")

    def solution(self) -> list[list[Any]]:
        """Per instruction, the calls ``{"name", "arguments"}`` that complete it."""
        raise NotImplementedError(f"{type(self).__name__} must implement solution(self)")

    # --- framework side -------------------------------------------------------------------
    @classmethod
    def tool_schemas(cls) -> dict[str, dict[str, Any]]:
        """The declared tools by name, normalised to ``{"name", "description", "parameters"}``."""
        tools = [normalize_tool(t) for t in cls.tools]
        return {str(t["name"]): t for t in tools}

    @classmethod
    def tools_openai(cls) -> list[dict[str, Any]]:
        """The tools in OpenAI form: ``[{"type": "function", "function": {name, description, parameters}}]``."""
        return [{"type": "function", "function": t} for t in cls.tool_schemas().values()]

    @classmethod
    def declaration_problems(cls) -> list[str]:
        """What is wrong with the class's tool declarations and tool methods (empty when fine)."""
        if not isinstance(cls.tools, list) or not cls.tools:
            return ["'tools' must be a non-empty list of OpenAI function schemas"]
        problems: list[str] = []
        seen: set[str] = set()
        for declaration in cls.tools:
            try:
                tool = normalize_tool(declaration)
            except ValueError as exc:
                problems.append(str(exc))
                continue
            found = tool_problems(tool)
            problems += found
            name = tool["name"]
            if found and not isinstance(name, str):
                continue
            if name in seen:
                problems.append(f"tool {name!r} is declared twice")
            seen.add(name)
            method = getattr(cls, f"tool_{name}", None)
            if not callable(method):
                problems.append(f"tool {name!r} has no method tool_{name}(self, ...)")
            elif not found:
                problems += _signature_problems(name, method, tool["parameters"])
        return problems

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        """Start an episode on the instance ``seed`` selects; see the module docstring."""
        self.rng = random.Random(seed)
        self.turn = 0
        self.current = 0
        self.state = {}
        self.instructions = []
        self.criteria = []
        self.criterion_errors = {}
        self.setup(self.rng)
        count = len(self.instructions)
        if not (MIN_INSTRUCTIONS <= count <= MAX_INSTRUCTIONS):
            raise ValueError(f"setup() must set {MIN_INSTRUCTIONS}-{MAX_INSTRUCTIONS} instructions, got {count}")
        if len(self.criteria) != count or not all(callable(c) for c in self.criteria):
            raise ValueError(
                f"setup() must set one callable criterion per instruction: {count} instructions, "
                f"{len(self.criteria)} criteria"
            )
        info = {
            "tools": self.tools_openai(),
            "instruction": self.instructions[0],
            "instruction_index": 0,
            "num_instructions": count,
        }
        return self.instructions[0], info

    def criterion_holds(self, index: int) -> bool:
        """Whether the criterion of instruction ``index`` holds on the current state.

        A criterion that raises (typically: it looks up a record the agent has not created yet)
        does not hold; the error is kept in ``criterion_errors[index]`` for the checker's findings.
        """
        try:
            held = bool(self.criteria[index](self.state))
        except Exception as exc:
            self.criterion_errors[index] = f"{type(exc).__name__}: {exc}"[:200]
            return False
        self.criterion_errors.pop(index, None)
        return held

    def call_tool(self, call: ToolCall) -> tuple[str, bool]:
        """Run one call against the backend; returns (output, ok). Never raises for agent errors."""
        schemas = self.tool_schemas()
        schema = schemas.get(call.name)
        if schema is None:
            return f"Error: unknown tool {call.name!r}; available tools: {', '.join(schemas)}", False
        problems = validate_arguments(schema["parameters"], call.arguments)
        if problems:
            return f"Error: bad arguments for {call.name}: " + "; ".join(problems), False
        try:
            result = getattr(self, f"tool_{call.name}")(**call.arguments)
        except Exception as exc:  # The agent sees the tool's error and can recover (Error Recovery skill).
            return f"Error: {call.name} failed: {type(exc).__name__}: {exc}", False
        if isinstance(result, str):
            return result, True
        return json.dumps(result, ensure_ascii=False, sort_keys=True, default=str), True

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Run the tool calls in ``action``; see the module docstring for the semantics."""
        if not self.instructions:
            raise RuntimeError("step() called before reset(); call reset(seed) first")
        if self.current >= len(self.instructions):
            raise RuntimeError("the episode is over (all instructions complete); call reset(seed)")
        self.turn += 1
        parsed = parse_tool_calls(action)
        lines: list[str] = [f"Error: malformed tool call: {e}" for e in parsed.errors]
        results: list[dict[str, Any]] = []
        new_instruction: str | None = None
        for call in parsed.calls:
            if self.current >= len(self.instructions):
                output, ok = "Not run: all instructions are already complete.", False
            else:
                index = self.current
                before = self.criterion_holds(index)
                output, ok = self.call_tool(call)
                if not before and self.criterion_holds(index):
                    self.current += 1
                    if self.current < len(self.instructions):
                        new_instruction = self.instructions[self.current]
            results.append({"name": call.name, "arguments": call.arguments, "output": output, "ok": ok})
            lines.append(f"[{call.name}] {output}")
        if not parsed.calls and not parsed.errors:
            lines.append(
                'No tool call found. Call a tool as <tool_call>{"name": ..., "arguments": {...}}</tool_call>. '
                f"The open request is: {self.instructions[self.current]}"
            )
        done = self.current >= len(self.instructions)
        if done:
            lines.append("[ALL INSTRUCTIONS COMPLETE]")
        elif new_instruction is not None:
            lines.append(f"[INSTRUCTION {self.current} COMPLETE] New instruction: {new_instruction}")
        truncated = not done and self.turn >= self.max_turns
        info: dict[str, Any] = {
            "tool_results": results,
            "errors": list(parsed.errors),
            "instruction_index": self.current,
            "num_instructions": len(self.instructions),
        }
        if new_instruction is not None:
            info["new_instruction"] = new_instruction
        return "\n".join(lines), (1.0 if done else 0.0), done, truncated, info

    def solution_calls(self) -> list[list[ToolCall]]:
        """``solution()`` normalised to ``ToolCall`` lists, one per instruction.

        Raises:
            ValueError: when the shape is wrong (not one list of calls per instruction).
        """
        raw = self.solution()
        if not isinstance(raw, list | tuple) or len(raw) != len(self.instructions):
            got = len(raw) if isinstance(raw, list | tuple) else type(raw).__name__
            raise ValueError(
                f"solution() must return one list of calls per instruction "
                f"({len(self.instructions)} instructions), got {got}"
            )
        out: list[list[ToolCall]] = []
        for i, item in enumerate(raw):
            block = [item] if isinstance(item, dict | ToolCall) else item
            if not isinstance(block, list | tuple) or not block:
                raise ValueError(f"solution()[{i}] must be a non-empty list of calls, got {block!r:.80}")
            out.append([as_tool_call(c) for c in block])
        return out
