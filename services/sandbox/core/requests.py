"""Rules every request must satisfy before it reaches the sandbox, shared by the gRPC and REST adapters."""

from __future__ import annotations

import posixpath
from dataclasses import dataclass

from services.sandbox.core.errors import InvalidRequest, PayloadTooLarge
from spade.envs.types import SETTINGS
from spade.errors import require_text

SEED_MIN, SEED_MAX = 0, 2**63 - 1
MAX_TURN_BUDGET = 1000
"""The largest agent turn budget a request may name (``CheckConfig.max_turns_cap``'s own bound)."""


@dataclass(frozen=True)
class RequestLimits:
    """Sizes the service accepts (from settings)."""

    max_code_bytes: int
    max_action_bytes: int
    max_stdin_bytes: int
    max_files: int
    max_files_bytes: int
    max_timeout_s: float
    max_memory_mb: int


def check_code(code: object, limits: RequestLimits) -> str:
    """Return ``code`` if it is a non-empty string within the size limit."""
    if not isinstance(code, str):
        raise InvalidRequest(f"'code' must be a string of Python source, got {type(code).__name__}")
    size = len(code.encode("utf-8", "surrogatepass"))
    if size > limits.max_code_bytes:
        raise PayloadTooLarge(f"'code' is {size} bytes, the limit is {limits.max_code_bytes}: send less code")
    if not code.strip():
        raise InvalidRequest("'code' is empty: send the Python source to run")
    if "\x00" in code:
        raise InvalidRequest("'code' contains a NUL byte: send plain UTF-8 Python source", field="code")
    return require_text(code, "code", InvalidRequest)


def check_setting(setting: object) -> str:
    if setting not in SETTINGS:
        raise InvalidRequest(f"'setting' must be one of {list(SETTINGS)}, got {setting!r:.40}")
    return str(setting)


def check_seed(seed: object) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise InvalidRequest(f"'seed' must be an integer, got {type(seed).__name__}")
    if not SEED_MIN <= seed <= SEED_MAX:
        raise InvalidRequest(f"'seed' must be in [{SEED_MIN}, {SEED_MAX}], got {seed}")
    return seed


def check_turn_budget(turns: object) -> int:
    """The agent's turn budget a request names: 0 (the service's configured one) to ``MAX_TURN_BUDGET``."""
    if isinstance(turns, bool) or not isinstance(turns, int):
        raise InvalidRequest(f"'agent_max_turns' must be an integer, got {type(turns).__name__}")
    if not 0 <= turns <= MAX_TURN_BUDGET:
        raise InvalidRequest(
            f"'agent_max_turns' must be in [0, {MAX_TURN_BUDGET}] (0 = the sandbox's configured budget), got {turns}"
        )
    return turns


def check_action(action: object, limits: RequestLimits) -> str:
    if not isinstance(action, str):
        raise InvalidRequest(f"'action' must be a string, got {type(action).__name__}")
    size = len(action.encode("utf-8", "surrogatepass"))
    if size > limits.max_action_bytes:
        raise PayloadTooLarge(f"'action' is {size} bytes, the limit is {limits.max_action_bytes}")
    # A surrogate the caller sent is the caller's error, never the env's (it would fail on the env channel).
    return require_text(action, "action", InvalidRequest)


def check_execution(
    stdin: bytes, files: dict[str, bytes], timeout_s: float, memory_mb: int, limits: RequestLimits
) -> None:
    """Validate an execution's stdin, files and requested limits (0 = service default)."""
    if len(stdin) > limits.max_stdin_bytes:
        raise PayloadTooLarge(f"'stdin' is {len(stdin)} bytes, the limit is {limits.max_stdin_bytes}")
    if len(files) > limits.max_files:
        raise PayloadTooLarge(f"{len(files)} files sent, the limit is {limits.max_files}")
    total = sum(len(content) for content in files.values())
    if total > limits.max_files_bytes:
        raise PayloadTooLarge(f"files total {total} bytes, the limit is {limits.max_files_bytes}")
    for path in files:
        check_file_path(path)
    if not 0 <= timeout_s <= limits.max_timeout_s:
        raise InvalidRequest(f"'timeout_s' must be in [0, {limits.max_timeout_s}] (0 = default), got {timeout_s}")
    if not 0 <= memory_mb <= limits.max_memory_mb:
        raise InvalidRequest(f"'memory_mb' must be in [0, {limits.max_memory_mb}] (0 = default), got {memory_mb}")


def check_file_path(path: str) -> str:
    """Accept only plain relative paths inside the execution's working directory, as UTF-8 text."""
    require_text(path, "files path", InvalidRequest)
    normal = posixpath.normpath(path) if path else ""
    if (
        not path
        or path.startswith("/")
        or "\x00" in path
        or normal.startswith("..")
        or normal in (".", "")
        or len(path) > 255
    ):
        raise InvalidRequest(
            f"file path {path[:80]!r} is not allowed: use a relative path inside the working directory"
        )
    return normal
