"""How a check reports a finding: raise ``CheckFailed`` with the rule, the value and the fix."""

from __future__ import annotations

from typing import Any


class CheckFailed(Exception):
    """A check's finding that the env breaks its rule (the message is the detail)."""


def short(value: Any, limit: int = 120) -> str:
    """``repr`` of ``value`` as one line of at most ``limit`` characters, for findings."""
    text = str(value).replace("\n", " ")
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")
