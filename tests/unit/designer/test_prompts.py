"""Designer prompts: every ingredient present, and the token budget honoured by shrinking in order."""

from __future__ import annotations

import pytest

from services.designer.core.parsing import HINT_MARKER, ParsedOutput, parse_output
from services.designer.core.ports import MemoryExample, MemoryExamples
from services.designer.core.prompts import (
    TRUNCATION_MARK,
    ExampleEnv,
    PromptParts,
    PromptTooLong,
    fit_prompt,
    render_messages,
    truncate_words,
)
from services.designer.core.skills import skill_named

EXAMPLE = ExampleEnv(name="CoinEnv", code="class CoinEnv:\n    max_turns = 5\n", hint="Pairs cancel out.")
DOC = " ".join(f"word{i}" for i in range(400))


def words_tokenize(messages: list[dict[str, str]]) -> list[int]:
    """A stand-in tokenizer: one token per whitespace word (budget logic only)."""
    return list(range(sum(len(m["content"].split()) for m in messages)))


def parts(**overrides: object) -> PromptParts:
    memory = MemoryExamples(
        positives=(MemoryExample(code="class GoodEnv:\n    pass", reason="learnable: win rate 0.45, regret 0.30"),),
        negatives=(MemoryExample(code="class EasyEnv:\n    pass", reason="too easy: win rate 0.97"),),
    )
    base: dict[str, object] = {
        "setting": "game",
        "skill": skill_named("game", "Optimization"),
        "document": DOC,
        "example": EXAMPLE,
        "memory": memory,
    }
    base.update(overrides)
    return PromptParts(**base)  # type: ignore[arg-type]


def test_game_prompt_carries_every_ingredient() -> None:
    system, user = render_messages(parts())
    assert system["role"] == "system" and HINT_MARKER in system["content"]
    text = user["content"]
    assert "reset(self, seed=None)" in text and "solution(self)" in text  # the contract
    assert "class CoinEnv" in text and "Pairs cancel out." in text  # the example, with its hint
    assert "Optimization" in text and "budget" in text  # skill and its description
    assert "word399" in text and "<REFERENCE_DOCUMENT>" in text  # the document
    assert "class GoodEnv" in text and "regret 0.30" in text  # positives: code + reason
    assert "class EasyEnv" in text and "too easy" in text  # negatives: code + reason
    assert "random or do-nothing player must lose" in text  # difficulty guidance


def test_the_example_is_shown_in_the_exact_answer_format_the_parser_reads() -> None:
    text = render_messages(parts())[1]["content"]
    start = text.index("```python")
    example_answer = text[start : text.index("## Reference document")]
    assert parse_output(example_answer) == ParsedOutput(code=EXAMPLE.code.strip(), hint=EXAMPLE.hint)


def test_tool_prompt_uses_the_tool_contract_and_plan_hints() -> None:
    text = render_messages(parts(setting="tool", skill=skill_named("tool", "Error Recovery")))[1]["content"]
    assert "from spade.envs import ToolEnv" in text and "setup(self, rng)" in text and "criteria" in text
    assert "False right after setup" in text
    assert "step plan" in text and "no argument values" in text


def test_a_prompt_that_fits_is_left_whole() -> None:
    fitted = fit_prompt(parts(), words_tokenize, max_prompt_tokens=100_000)
    assert fitted.parts == parts()
    assert len(fitted.prompt_ids) == len(words_tokenize(fitted.messages))


def test_the_document_shrinks_first_then_memory_then_the_example() -> None:
    full = len(words_tokenize(render_messages(parts())))
    doc_cut = fit_prompt(parts(), words_tokenize, max_prompt_tokens=full - 150, doc_min_words=50)
    assert doc_cut.parts.memory == parts().memory
    assert doc_cut.parts.document.endswith(TRUNCATION_MARK)
    assert len(doc_cut.prompt_ids) <= full - 150

    no_doc = render_messages(parts(document="", memory=MemoryExamples()))
    budget = len(words_tokenize(no_doc)) + 20
    tight = fit_prompt(parts(), words_tokenize, max_prompt_tokens=budget, doc_min_words=50)
    assert tight.parts.memory == MemoryExamples()
    assert tight.parts.example == EXAMPLE
    assert len(tight.prompt_ids) <= budget

    bare = render_messages(parts(document="", memory=MemoryExamples(), example=None))
    tiniest = fit_prompt(parts(), words_tokenize, max_prompt_tokens=len(words_tokenize(bare)))
    assert tiniest.parts.example is None and tiniest.parts.document == ""


def test_an_impossible_budget_is_a_clear_error() -> None:
    with pytest.raises(PromptTooLong, match="MAX_PROMPT_TOKENS"):
        fit_prompt(parts(), words_tokenize, max_prompt_tokens=10)


def test_truncate_words_keeps_layout_and_marks_the_cut() -> None:
    assert truncate_words("a\n\nb c", 2) == "a\n\nb\n" + TRUNCATION_MARK
    assert truncate_words("a b", 2) == "a b"
    assert truncate_words("a b", 0) == ""
