"""Known repairs: boxed braces in f-strings whatever their content; valid code left alone."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spade.envs.examples import EXAMPLES
from spade.envs.repair import (
    _odd_backslash_boxed,
    _opens_triple_fstring,
    _repair_thoroughly,
    extract_code,
    needs_repair,
    repair_code,
)


def run(code: str) -> dict:
    namespace: dict = {}
    exec(compile(code, "<test>", "exec"), namespace)
    return namespace


def test_boxed_placeholder_that_does_not_parse_is_fixed() -> None:
    code = 'n = 3\nmsg = f"Actions: \\\\boxed{push N} or \\\\boxed{pop} ({n} left)"\n'
    fixed, repairs = repair_code(code)
    assert run(fixed)["msg"] == "Actions: \\boxed{push N} or \\boxed{pop} (3 left)"
    assert repairs and "boxed" in repairs[0]


def test_boxed_word_that_parses_but_would_raise_is_fixed() -> None:
    """`f"\\\\boxed{done}"` parses, then raises NameError when run; the reference left it broken."""
    code = 'msg = f"Reply \\\\boxed{done} when finished"\n'
    with pytest.raises(NameError):
        run(code)
    fixed, repairs = repair_code(code)
    assert run(fixed)["msg"] == "Reply \\boxed{done} when finished"
    assert repairs


def test_boxed_with_an_interpolated_value_inside() -> None:
    code = 'k = 7\nmsg = f"Try \\\\boxed{move {k}}"\n'
    fixed, _ = repair_code(code)
    assert run(fixed)["msg"] == "Try \\boxed{move 7}"


def test_triple_quoted_and_raw_fstrings() -> None:
    code = 'x = 2\nmsg = f"""Use\n\\\\boxed{answer}\nnow {x}"""\nraw = rf"\\boxed{go} {x}"\n'
    fixed, _ = repair_code(code)
    namespace = run(fixed)
    assert namespace["msg"] == "Use\n\\boxed{answer}\nnow 2"
    assert namespace["raw"] == "\\boxed{go} 2"


def test_backspace_boxed_in_plain_string_is_fixed() -> None:
    code = 'msg = "Reply \\boxed{yes}"\n'
    assert "\x08" in run(code)["msg"]
    fixed, repairs = repair_code(code)
    assert run(fixed)["msg"] == "Reply \\boxed{yes}"
    assert any("backspace" in r for r in repairs)


def test_other_non_expression_fields_are_fixed_only_when_the_code_does_not_parse() -> None:
    code = 'msg = f"Commands: {go north}, {x}"\nx = 1\n'
    fixed, repairs = repair_code(code)
    assert "{{go north}}" in fixed and "{x}" in fixed
    assert repairs


VALID = [
    'x, y, d = 1.5, "s", {"k": 2}\nm = f"{x:>8.2f} {y!r} {x=} {d[\'k\']} {{literal}} {x if x else y}"\n',
    'n = 3\nm = f"\\\\boxed{{{n}}}"\n',  # already escaped, interpolating n inside the box
    'import re\np = re.compile(r"\\\\boxed\\{(.*?)\\}")\nq = "\\\\boxed{ok}"\n',
    "m = b'\\\\boxed{bytes}'\n",
    "def f():\n    return {'a': [1, 2]}\n",
]


@pytest.mark.parametrize("code", VALID)
def test_valid_code_is_untouched(code: str) -> None:
    assert repair_code(code) == (code, [])


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_envs_are_untouched(name: str) -> None:
    code = EXAMPLES[name].code
    assert repair_code(code) == (code, [])


def test_code_that_cannot_be_repaired_is_returned_unparsed() -> None:
    code = "def broken(:\n    pass\n"
    assert repair_code(code) == (code, [])


def test_repair_is_idempotent() -> None:
    once, _ = repair_code('m = f"\\\\boxed{push N} {1+1}"\n')
    assert repair_code(once) == (once, [])


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        ("Here is the env:\n```python\nx = 1\n```\nHint: think.", "x = 1\n"),
        ("```py\na = 2\n```\n```python\nb = 3\n```", "a = 2\n"),
        ("```\nc = 4\n```", "c = 4\n"),
        ("```python\nd = 5\n", "d = 5\n"),  # cut-off reply
        ("e = 6\n", "e = 6\n"),
    ],
)
def test_extract_code(reply: str, expected: str) -> None:
    assert extract_code(reply) == expected


def test_boxed_value_expressions_are_interpolated_inside_the_box() -> None:
    """`f"\\\\boxed{self.secret}"` meant the value in a box; a bare word stays a literal command."""
    code = (
        "class G:\n"
        "    def __init__(self):\n"
        "        self.secret = 42\n"
        "        done = False\n"
        '        self.a = f"\\\\boxed{self.secret}"\n'
        '        self.b = f"\\\\boxed{len(str(self.secret))} \\\\boxed{done} \\\\boxed{max}"\n'
        "g = G()\n"
    )
    fixed, repairs = repair_code(code)
    g = run(fixed)["g"]
    assert g.a == "\\boxed{42}"
    assert g.b == "\\boxed{2} \\boxed{done} \\boxed{max}"
    assert repairs


NEEDING = [
    'n = 3\nmsg = f"Actions: \\\\boxed{push N} or \\\\boxed{pop} ({n} left)"\n',
    'msg = f"Reply \\\\boxed{done} when finished"\n',
    'k = 7\nmsg = f"Try \\\\boxed{move {k}}"\n',
    'x = 2\nmsg = f"""Use\n\\\\boxed{answer}\nnow {x}"""\nraw = rf"\\boxed{go} {x}"\n',
    'msg = "Reply \\boxed{yes}"\n',
    'msg = (\n    "Say "\n    f"\\\\boxed{go}"\n)\n',
    'msg = F"Reply \\\\boxed {done}"\n',
    'msg = "first " \\\nf"\\\\boxed{x}"\n',
    "\ufeffx = 1\n",
]


@pytest.mark.parametrize("code", NEEDING)
def test_the_cheap_test_sends_every_code_a_repair_changes_to_the_tokenizer(code: str) -> None:
    assert needs_repair(code)
    assert repair_code(code)[0] != code


CORPUS = [*VALID, *(e.code for e in EXAMPLES.values()), 'q = "\\\\boxed{ok}"\nm = f"{q}!"\n']


@pytest.mark.parametrize("code", CORPUS)
def test_code_the_cheap_test_passes_is_code_the_repairs_leave_alone(code: str) -> None:
    """The fast path is exact: wherever it skips the tokenizer, the tokenizer would change nothing."""
    if not needs_repair(code):
        assert _repair_thoroughly(code) == (code, [])
    assert repair_code(code) == _repair_thoroughly(code)


def test_example_game_envs_take_the_fast_path() -> None:
    assert [e.name for e in EXAMPLES.values() if needs_repair(e.code)] == []


# The cheap test's two scans, as the patterns they replace (the rule, stated once as a regex).
ODD_BACKSLASH_BOXED = re.compile(r"(?<!\\)(?:\\\\)*\\boxed")
FSTRING_TRIPLE = re.compile(r"""(?<!\w)(?:[rRbB]?[fF]|[fF][rRbB])(?:'''|\"\"\")""")
PIECES = ["\\", "\\\\", "boxed", "{", "}", "f", "F", "r", "B", "_", "a", "1", "é", "İ", " ", "\n", "'", '"']
PIECES += ["'''", '"""']


@pytest.mark.slow
@settings(max_examples=3000, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=14).map("".join))
def test_the_cheap_scans_find_what_their_patterns_find(code: str) -> None:
    assert _odd_backslash_boxed(code) == bool(ODD_BACKSLASH_BOXED.search(code))
    assert _opens_triple_fstring(code) == bool(FSTRING_TRIPLE.search(code))
