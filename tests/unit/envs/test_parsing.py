"""``spade.envs.parsing.parse``: two threads parsing at once do not corrupt each other's parse.

CPython 3.11's ``ast.parse`` keeps its recursion counter per interpreter. A parse on another thread
that runs while one is building its AST (the garbage collector runs finalisers inside ``ast.parse``,
and a finaliser lets other threads run) makes the first raise ``SystemError: AST constructor
recursion depth mismatch``. The test forces that interleaving: while the main thread parses, every
finaliser the collector runs on it starts a parse on a fresh thread and gives it time to finish.
"""

from __future__ import annotations

import ast
import contextlib
import gc
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from spade.envs import parsing
from spade.envs.parsing import parse

SOURCE = (Path(parsing.__file__).parent / "checker.py").read_text()


def parse_while_others_parse(parser: Callable[[str], ast.AST]) -> list[BaseException]:
    """Parse ``SOURCE`` deep in the stack while finalisers start shallow parses on other threads."""
    errors: list[BaseException] = []
    others: list[threading.Thread] = []
    main = threading.current_thread()
    parsing_now = threading.Event()

    def other() -> None:
        try:
            parser("x = [1, (2, {3: 4})]\n" * 50)
        except BaseException as exc:
            errors.append(exc)

    class Finaliser:
        """Cyclic garbage whose finaliser starts another parse and renews itself."""

        def __init__(self) -> None:
            self.me = self

        def __del__(self) -> None:
            if threading.current_thread() is main and parsing_now.is_set() and len(others) < 20:
                thread = threading.Thread(target=other)
                others.append(thread)
                thread.start()
                thread.join(0.05)  # long enough for an unguarded parse to run to its end here
                Finaliser()

    def deep(depth: int) -> None:
        if depth:
            return deep(depth - 1)
        Finaliser()
        parsing_now.set()
        try:
            parser(SOURCE)
        except BaseException as exc:
            errors.append(exc)
        finally:
            parsing_now.clear()
        return None

    threshold = gc.get_threshold()
    gc.set_threshold(50)  # collect (and so finalise) often inside the parse
    try:
        deep(60)
    finally:
        gc.set_threshold(*threshold)
        for thread in others:
            thread.join(10)
    assert others, "no finaliser ran during the parse: the test did not interleave anything"
    return errors


def test_parses_on_other_threads_wait_for_the_one_in_progress() -> None:
    assert parse_while_others_parse(parse) == []


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="the race is CPython 3.11's (the project's Python)")
def test_the_test_catches_the_race_it_guards_against(monkeypatch: pytest.MonkeyPatch) -> None:
    """Control: with the lock taken away, the same interleaving breaks ``ast.parse`` (Python 3.11)."""
    monkeypatch.setattr(parsing, "_ONE_AT_A_TIME", contextlib.nullcontext())
    errors = parse_while_others_parse(parse)
    assert any(isinstance(e, SystemError) and "recursion depth mismatch" in str(e) for e in errors), errors
