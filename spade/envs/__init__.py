"""The environment contract library (DESIGN §3, §4, §6).

Shared by the LLM-written environments and the whole framework. Everything in this package except
``gym_adapter`` uses the Python standard library only: it is copied into the sandbox, where
untrusted env code runs under a bare ``python3.11``. See ``docs/environments.md``.
"""

from spade.envs.actions import (
    ToolCall,
    ToolCallParse,
    normalize_game_action,
    parse_boxed,
    parse_tool_calls,
)
from spade.envs.checker import check_env_source
from spade.envs.contract import ContractError, GameEnv, GameEnvContract
from spade.envs.loader import LoadResult, load_env_class
from spade.envs.repair import extract_code, repair_code

# Imported last: they build on the names above.
from spade.envs.session import EnvLoadError, EnvSession, SessionError
from spade.envs.tool_env import ToolEnv
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
    "ContractError",
    "EnvLoadError",
    "EnvSession",
    "GameEnv",
    "GameEnvContract",
    "LoadResult",
    "Outcome",
    "SessionError",
    "Setting",
    "StepOutcome",
    "ToolCall",
    "ToolCallParse",
    "ToolEnv",
    "ValidationReport",
    "check_env_source",
    "extract_code",
    "load_env_class",
    "normalize_game_action",
    "parse_boxed",
    "parse_tool_calls",
    "repair_code",
]
