"""The environment contract library (DESIGN §3, §4, §6).

Shared by the LLM-written environments and the whole framework. Everything in this package except
``gym_adapter`` uses the Python standard library only: it is copied into the sandbox, where
untrusted env code runs under a bare ``python3.11``.
"""

from spade.envs.actions import (
    ToolCall,
    ToolCallParse,
    normalize_game_action,
    parse_boxed,
    parse_tool_calls,
)
from spade.envs.types import (
    CHECK_NAMES,
    CheckConfig,
    CheckResult,
    Outcome,
    Setting,
    StepOutcome,
    ValidationReport,
)

__all__ = [
    "CHECK_NAMES",
    "CheckConfig",
    "CheckResult",
    "Outcome",
    "Setting",
    "StepOutcome",
    "ToolCall",
    "ToolCallParse",
    "ValidationReport",
    "normalize_game_action",
    "parse_boxed",
    "parse_tool_calls",
]
