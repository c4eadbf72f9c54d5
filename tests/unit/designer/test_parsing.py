"""Parsing the designer's answer into code and hint: robust, and strict about the hint."""

from __future__ import annotations

from services.designer.core.parsing import ParsedOutput, ParseFailure, parse_output, split_hint

CODE = "import random\n\nclass CoinEnv:\n    max_turns = 5\n"


def test_the_canonical_answer_parses_into_code_and_hint() -> None:
    text = f"Here is my game.\n```python\n{CODE}```\n### HINT\nCount the coins before moving.\n"
    parsed = parse_output(text)
    assert parsed == ParsedOutput(code=CODE.strip(), hint="Count the coins before moving.")


def test_a_missing_hint_is_an_invalid_attempt_with_a_reason() -> None:
    parsed = parse_output(f"```python\n{CODE}```\nThat's all.")
    assert isinstance(parsed, ParseFailure)
    assert parsed.check == "output_format"
    assert "### HINT" in parsed.detail


def test_an_empty_hint_section_is_invalid() -> None:
    parsed = parse_output(f"```python\n{CODE}```\n### HINT\n\n")
    assert isinstance(parsed, ParseFailure)
    assert "empty" in parsed.detail


def test_a_hint_comment_inside_the_code_is_not_the_hint_section() -> None:
    code = "class AEnv:\n    ### HINT\n    x = 1\n"
    parsed = parse_output(f"```python\n{code}```\n## Hint: think in pairs")
    assert isinstance(parsed, ParsedOutput)
    assert "### HINT" in parsed.code
    assert parsed.hint == "think in pairs"


def test_marker_variants_small_models_write() -> None:
    for marker in ("### HINT", "## Hint", "HINT:", "**Hint:**", "### Hint:", "<hint>"):
        parsed = parse_output(f"```python\n{CODE}```\n{marker}\nPairs cancel out.")
        assert isinstance(parsed, ParsedOutput), marker
        assert parsed.hint == "Pairs cancel out."


def test_an_unclosed_fence_before_the_marker_still_parses() -> None:
    parsed = parse_output(f"```python\n{CODE}### HINT\nPairs cancel out.")
    assert isinstance(parsed, ParsedOutput)
    assert parsed.code == CODE.strip()
    assert parsed.hint == "Pairs cancel out."


def test_no_environment_class_is_invalid() -> None:
    parsed = parse_output("```python\nprint('hi')\n```\n### HINT\nnothing")
    assert isinstance(parsed, ParseFailure)
    assert "class" in parsed.detail


def test_empty_answer_and_overlong_hint() -> None:
    assert isinstance(parse_output("   "), ParseFailure)
    parsed = parse_output(f"```python\n{CODE}```\n### HINT\n" + "word " * 1000, max_hint_chars=50)
    assert isinstance(parsed, ParsedOutput)
    assert len(parsed.hint) <= 50


def test_split_hint_returns_none_without_a_marker_outside_code() -> None:
    assert split_hint("```python\nclass AEnv: pass\n```\n") is None


def test_prose_mentioning_hints_before_the_code_is_not_the_marker() -> None:
    text = f"Hint: I will write a coin game.\n```python\n{CODE}```\n### HINT\nPairs cancel out."
    parsed = parse_output(text)
    assert isinstance(parsed, ParsedOutput)
    assert parsed.hint == "Pairs cancel out."
    assert isinstance(parse_output(f"Hints matter.\n```python\n{CODE}```\nno marker"), ParseFailure)


def test_a_hint_tag_is_read_without_the_tags() -> None:
    parsed = parse_output(f"```python\n{CODE}```\n<hint>Pairs cancel out.</hint>")
    assert isinstance(parsed, ParsedOutput)
    assert parsed.hint == "Pairs cancel out."
