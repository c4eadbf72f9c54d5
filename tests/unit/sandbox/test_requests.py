"""Input rules applied before anything reaches the sandbox."""

from __future__ import annotations

import pytest

from services.sandbox.core.errors import InvalidRequest, PayloadTooLarge
from services.sandbox.core.requests import (
    RequestLimits,
    check_action,
    check_code,
    check_execution,
    check_file_path,
    check_seed,
    check_setting,
)

LIMITS = RequestLimits(
    max_code_bytes=100,
    max_action_bytes=10,
    max_stdin_bytes=5,
    max_files=2,
    max_files_bytes=8,
    max_timeout_s=30.0,
    max_memory_mb=512,
)


def test_code_rules() -> None:
    assert check_code("print(1)", LIMITS) == "print(1)"
    with pytest.raises(PayloadTooLarge, match="limit is 100"):
        check_code("x" * 101, LIMITS)
    for bad in ["", "   \n", "a\x00b", "\udcff"]:
        with pytest.raises(InvalidRequest):
            check_code(bad, LIMITS)
    with pytest.raises(InvalidRequest, match="must be a string"):
        check_code(b"print(1)", LIMITS)


def test_setting_seed_and_action_rules() -> None:
    assert check_setting("tool") == "tool"
    with pytest.raises(InvalidRequest):
        check_setting("chess")
    assert check_seed(7) == 7
    for bad in [-1, 2**63, True, "3", 1.5]:
        with pytest.raises(InvalidRequest):
            check_seed(bad)
    with pytest.raises(PayloadTooLarge):
        check_action("a" * 11, LIMITS)
    with pytest.raises(InvalidRequest):
        check_action(None, LIMITS)


@pytest.mark.parametrize("path", ["/etc/passwd", "../x", "a/../../x", "", ".", "a\x00"])
def test_file_paths_stay_inside_the_working_directory(path: str) -> None:
    with pytest.raises(InvalidRequest):
        check_file_path(path)


def test_execution_limits() -> None:
    check_execution(b"12345", {"a/b.txt": b"1234", "c": b"5678"}, 30.0, 512, LIMITS)
    with pytest.raises(PayloadTooLarge):
        check_execution(b"123456", {}, 0, 0, LIMITS)
    with pytest.raises(PayloadTooLarge):
        check_execution(b"", {"a": b"", "b": b"", "c": b""}, 0, 0, LIMITS)
    with pytest.raises(PayloadTooLarge):
        check_execution(b"", {"a": b"123456789"}, 0, 0, LIMITS)
    with pytest.raises(InvalidRequest, match="timeout_s"):
        check_execution(b"", {}, 31.0, 0, LIMITS)
    with pytest.raises(InvalidRequest, match="memory_mb"):
        check_execution(b"", {}, 0, 513, LIMITS)
