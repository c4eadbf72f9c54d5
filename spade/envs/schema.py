"""The subset of JSON Schema that tool parameters use: checking schemas and validating arguments.

Supported keywords: ``type`` (one or a list of ``object``, ``array``, ``string``, ``integer``,
``number``, ``boolean``, ``null``), ``properties``, ``required``, ``additionalProperties``
(boolean), ``items``, ``enum``, ``minimum``, ``maximum``, ``minItems``, ``maxItems``,
``description``. Unknown keywords are ignored. Standard library only.
"""

from __future__ import annotations

import keyword
import math
import re
from typing import Any

JSON_TYPES = ("object", "array", "string", "integer", "number", "boolean", "null")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _type_ok(value: Any, type_name: str) -> bool:
    if type_name == "object":
        return isinstance(value, dict)
    if type_name == "array":
        return isinstance(value, list)
    if type_name == "string":
        return isinstance(value, str)
    if type_name == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)) or (
            isinstance(value, float) and value.is_integer()
        )
    if type_name == "number":
        return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if type_name == "boolean":
        return isinstance(value, bool)
    if type_name == "null":
        return value is None
    return True


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def validate_value(schema: dict[str, Any], value: Any, path: str) -> list[str]:
    """Problems of ``value`` against ``schema``; ``path`` names the value in messages."""
    problems: list[str] = []
    declared = schema.get("type")
    types = [declared] if isinstance(declared, str) else list(declared or [])
    if types and not any(_type_ok(value, t) for t in types):
        return [f"{path} must be {' or '.join(types)}, got {type(value).__name__} {_short(value)}"]
    enum = schema.get("enum")
    if isinstance(enum, list) and value not in enum:
        problems.append(f"{path} must be one of {enum}, got {_short(value)}")
    if isinstance(value, int | float) and not isinstance(value, bool):
        low, high = schema.get("minimum"), schema.get("maximum")
        if isinstance(low, int | float) and value < low:
            problems.append(f"{path} must be >= {low}, got {value}")
        if isinstance(high, int | float) and value > high:
            problems.append(f"{path} must be <= {high}, got {value}")
    if isinstance(value, dict):
        properties = schema.get("properties") or {}
        for name in schema.get("required") or []:
            if name not in value:
                problems.append(f"{path} is missing required field {name!r}")
        for name, item in value.items():
            if name in properties:
                problems += validate_value(properties[name], item, f"{path}.{name}")
            elif schema.get("additionalProperties") is False:
                allowed = ", ".join(sorted(properties)) or "none"
                problems.append(f"{path} has unknown field {name!r} (allowed: {allowed})")
    if isinstance(value, list):
        low, high = schema.get("minItems"), schema.get("maxItems")
        if isinstance(low, int) and len(value) < low:
            problems.append(f"{path} needs at least {low} items, got {len(value)}")
        if isinstance(high, int) and len(value) > high:
            problems.append(f"{path} allows at most {high} items, got {len(value)}")
        items = schema.get("items")
        if isinstance(items, dict):
            for i, item in enumerate(value):
                problems += validate_value(items, item, f"{path}[{i}]")
    return problems


def validate_arguments(parameters: dict[str, Any], arguments: dict[str, Any]) -> list[str]:
    """Problems of a call's ``arguments`` against its tool's ``parameters`` schema.

    Top-level arguments become keyword arguments of the tool method, so unknown top-level names
    are always rejected.

    >>> validate_arguments({"type": "object", "properties": {"n": {"type": "integer"}},
    ...                     "required": ["n"]}, {"n": "3"})
    ["argument 'n' must be integer, got str '3'"]
    """
    problems: list[str] = []
    properties = parameters.get("properties") or {}
    for name in parameters.get("required") or []:
        if name not in arguments:
            problems.append(f"missing required argument {name!r}")
    for name, value in arguments.items():
        if name not in properties:
            allowed = ", ".join(sorted(properties)) or "none"
            problems.append(f"unknown argument {name!r} (allowed: {allowed})")
        else:
            problems += validate_value(properties[name], value, f"argument {name!r}")
    return problems


def schema_problems(schema: Any, path: str) -> list[str]:
    """Problems with a (nested) parameter schema itself."""
    if not isinstance(schema, dict):
        return [f"{path} must be a JSON-schema object, got {type(schema).__name__}"]
    problems: list[str] = []
    declared = schema.get("type")
    types = [declared] if isinstance(declared, str) else declared
    if declared is None and "enum" not in schema:
        problems.append(f"{path} has neither 'type' nor 'enum'")
    elif declared is not None and (not isinstance(types, list) or not types or any(t not in JSON_TYPES for t in types)):
        problems.append(f"{path} has type {declared!r}; use one of {', '.join(JSON_TYPES)}")
    enum = schema.get("enum")
    if enum is not None and (not isinstance(enum, list) or not enum):
        problems.append(f"{path}.enum must be a non-empty list, got {_short(enum)}")
    properties = schema.get("properties")
    if properties is not None:
        if not isinstance(properties, dict):
            problems.append(f"{path}.properties must be an object")
        else:
            for name, sub in properties.items():
                problems += schema_problems(sub, f"{path}.{name}")
    required = schema.get("required")
    if required is not None:
        known = properties if isinstance(properties, dict) else {}
        if not isinstance(required, list) or any(r not in known for r in required):
            problems.append(f"{path}.required must list names from properties, got {_short(required)}")
    items = schema.get("items")
    if items is not None:
        problems += schema_problems(items, f"{path}.items")
    elif types and "array" in (types or []):
        problems.append(f"{path} is an array without 'items'")
    return problems


def tool_problems(tool: dict[str, Any]) -> list[str]:
    """Problems with one normalised tool declaration ``{"name", "description", "parameters"}``."""
    name = tool.get("name")
    if not isinstance(name, str) or not _NAME.match(name) or keyword.iskeyword(name):
        return [f"tool name {name!r} must be a Python identifier (letters, digits, underscores)"]
    problems: list[str] = []
    if not isinstance(tool.get("description"), str) or not tool["description"].strip():
        problems.append(f"tool {name!r} needs a non-empty 'description'")
    params = tool.get("parameters")
    if not isinstance(params, dict) or params.get("type") != "object":
        problems.append(f"tool {name!r}: 'parameters' must be a schema with type 'object'")
        return problems
    for prop in params.get("properties") or {}:
        if not isinstance(prop, str) or not _NAME.match(prop) or keyword.iskeyword(prop):
            problems.append(f"tool {name!r}: parameter name {prop!r} must be a Python identifier")
    problems += [f"tool {name!r}: {p}" for p in schema_problems(params, "parameters")]
    return problems


def example_value(schema: dict[str, Any], rng: Any = None, pool: list[Any] | None = None) -> Any:
    """A value that satisfies ``schema`` (required fields only), for probing tools.

    With ``rng`` (a ``random.Random``), values are drawn at random: enum members, numbers in range,
    strings from ``pool`` when given.
    """
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return rng.choice(enum) if rng else enum[0]
    declared = schema.get("type")
    kind = declared if isinstance(declared, str) else (declared or ["string"])[0]
    if kind == "object":
        props = schema.get("properties") or {}
        return {k: example_value(props[k], rng, pool) for k in schema.get("required") or [] if k in props}
    if kind == "array":
        items = schema.get("items")
        count = max(int(schema.get("minItems") or 0), 1 if rng and rng.random() < 0.5 else 0)
        return [example_value(items, rng, pool) for _ in range(count)] if isinstance(items, dict) else []
    if kind in ("integer", "number"):
        low = schema.get("minimum", 0 if rng is None else -3)
        high = schema.get("maximum", low + 20)
        lo, hi = math.ceil(low), math.floor(high)
        value = rng.randint(lo, max(lo, hi)) if rng else lo
        return value if kind == "integer" else float(value)
    if kind == "boolean":
        return bool(rng.random() < 0.5) if rng else False
    if kind == "null":
        return None
    strings = [p for p in pool or [] if isinstance(p, str)]
    if rng and strings:
        return rng.choice(strings)
    return "x"
