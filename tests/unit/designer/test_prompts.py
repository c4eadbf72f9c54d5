"""Designer prompts: every ingredient present, and the token budget honoured by shrinking in order."""

from __future__ import annotations

from dataclasses import replace

import pytest

from services.designer.core.parsing import HINT_MARKER, ParsedOutput, parse_output
from services.designer.core.ports import MemoryExample, MemoryExamples
from services.designer.core.prompts import (
    MIN_EXAMPLE_LINES,
    TRUNCATION_MARK,
    AgentBudget,
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


LONG_EXAMPLE = ExampleEnv(
    name="LongEnv",
    code="class LongEnv:\n" + "".join(f"    step_{i} = {i}  # a line of the example\n" for i in range(200)),
    hint="Count the steps.",
)


def tokens(p: PromptParts) -> int:
    return len(words_tokenize(render_messages(p)))


def test_grounding_first_memory_and_the_example_give_way_before_the_document() -> None:
    full = parts(example=LONG_EXAMPLE)
    # A budget that holds the whole document and the example's shortest beginning, nothing more.
    budget = tokens(replace(full, memory=MemoryExamples(), example_lines=MIN_EXAMPLE_LINES)) + 2
    fitted = fit_prompt(full, words_tokenize, max_prompt_tokens=budget, doc_min_words=50)
    assert len(fitted.prompt_ids) <= budget
    assert fitted.parts.document == DOC  # the corpus document is whole
    assert fitted.parts.memory == MemoryExamples()  # memory examples went first
    assert fitted.parts.example == LONG_EXAMPLE and fitted.parts.example_lines == MIN_EXAMPLE_LINES  # then this
    assert "word399" in fitted.messages[1]["content"]


def test_a_shrunk_example_shows_its_beginning_in_the_answer_format() -> None:
    full = parts(example=LONG_EXAMPLE, memory=MemoryExamples())
    budget = tokens(replace(full, example_lines=60)) + 5
    fitted = fit_prompt(full, words_tokenize, max_prompt_tokens=budget, doc_min_words=50)
    assert fitted.parts.document == DOC and fitted.parts.example == LONG_EXAMPLE
    assert fitted.parts.example_lines is not None and fitted.parts.example_lines <= 60
    text = fitted.messages[1]["content"]
    assert "step_0 = 0" in text and "step_199" not in text
    assert "the rest of this example is omitted" in text and "its beginning" in text
    assert "Count the steps." in text  # the hint still closes the example answer


def test_under_a_tight_budget_the_example_goes_before_the_document_and_the_document_goes_last() -> None:
    full = parts(example=LONG_EXAMPLE)
    bare = tokens(replace(full, document="", memory=MemoryExamples(), example=None))
    # Room for the document cut to its floor (50 words) but not for any of the example as well.
    budget = bare + 80  # the section header adds about 15 words
    fitted = fit_prompt(full, words_tokenize, max_prompt_tokens=budget, doc_min_words=50)
    assert fitted.parts.example is None and fitted.parts.memory == MemoryExamples()
    assert fitted.parts.document.endswith(TRUNCATION_MARK) and "word49" in fitted.parts.document
    assert len(fitted.prompt_ids) <= budget

    tiniest = fit_prompt(full, words_tokenize, max_prompt_tokens=bare)
    assert tiniest.parts.example is None and tiniest.parts.document == ""


def test_memory_excerpts_are_shortened_before_memory_examples_are_dropped() -> None:
    long_code = "class GoodEnv:\n" + "".join(f"    field_{i} = {i}\n" for i in range(300))
    memory = MemoryExamples(positives=(MemoryExample(code=long_code, reason="learnable: win rate 0.5"),))
    full = parts(memory=memory, excerpt_chars=4000)
    budget = tokens(replace(full, excerpt_chars=1000)) + 2
    fitted = fit_prompt(full, words_tokenize, max_prompt_tokens=budget)
    assert fitted.parts.memory == memory and fitted.parts.excerpt_chars <= 1000
    assert fitted.parts.document == DOC and fitted.parts.example == EXAMPLE


@pytest.mark.parametrize("setting", ["game", "tool"])
def test_the_agents_budget_is_stated_in_the_contract(setting: str) -> None:
    skill = skill_named(setting, "Optimization" if setting == "game" else "Tool Selection")
    text = render_messages(parts(setting=setting, skill=skill, budget=AgentBudget(7, 512)))[1]["content"]
    assert "## The agent's budget" in text
    assert "at most 7 turns" in text and "512 tokens per turn" in text
    assert "`max_turns` must be at most 7" in text
    assert "within 7" in text  # solution() must win within the budget


def test_an_impossible_budget_is_a_clear_error() -> None:
    with pytest.raises(PromptTooLong, match="MAX_PROMPT_TOKENS"):
        fit_prompt(parts(), words_tokenize, max_prompt_tokens=10)


def test_truncate_words_keeps_layout_and_marks_the_cut() -> None:
    assert truncate_words("a\n\nb c", 2) == "a\n\nb\n" + TRUNCATION_MARK
    assert truncate_words("a b", 2) == "a b"
    assert truncate_words("a b", 0) == ""
