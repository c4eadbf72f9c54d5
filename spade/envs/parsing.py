"""Parse Python source safely in a process that parses on several threads.

CPython 3.11 keeps ``ast.parse``'s recursion counter in one per-interpreter slot, not per thread
(cpython gh-106905, fixed in later versions). When two threads build AST objects at once — a thread
switch happens inside ``ast.parse`` whenever the garbage collector runs a finaliser there — the
counter of one leaks into the other and ``ast.parse`` raises ``SystemError: AST constructor
recursion depth mismatch`` on code that parses fine. The services do parse on several threads at
once (the sandbox repairs code and the memory normalises it, each in ``asyncio.to_thread``), so
every ``ast.parse`` in SPADE goes through :func:`parse`, which lets one thread parse at a time.

Re-entrant, because a finaliser running inside a parse may itself parse. Standard library only (the
package is copied into the sandbox).
"""

from __future__ import annotations

import ast
import threading
from typing import Literal, overload

_ONE_AT_A_TIME = threading.RLock()


@overload
def parse(source: str, mode: Literal["exec"] = "exec") -> ast.Module: ...


@overload
def parse(source: str, mode: Literal["eval"]) -> ast.Expression: ...


def parse(source: str, mode: Literal["exec", "eval"] = "exec") -> ast.Module | ast.Expression:
    """``ast.parse(source, mode=mode)``, one thread at a time (see the module docstring)."""
    with _ONE_AT_A_TIME:
        tree = ast.parse(source, mode=mode)
    assert isinstance(tree, ast.Module | ast.Expression)
    return tree
