"""The reasoning-gym suite without a model: items, hardest configurations and the package's scorers."""

from __future__ import annotations

import dataclasses

import pytest

from services.eval.suites.reasoning_gym import (
    DEFAULT_DATASETS,
    PAPER_CATEGORIES,
    ReasoningGymSuite,
    SuiteConfigError,
    hardest_config,
)


@pytest.fixture(scope="module")
def suite() -> ReasoningGymSuite:
    return ReasoningGymSuite(None, seed=0, items_per_category=len(DEFAULT_DATASETS))


@pytest.mark.slow
def test_item_ids_and_questions_are_stable_for_a_seed(suite: ReasoningGymSuite) -> None:
    again = ReasoningGymSuite(None, seed=0, items_per_category=len(DEFAULT_DATASETS))
    assert [i.id for i in again.items()] == [i.id for i in suite.items()]
    first = suite.items()[:8]
    assert [again.entry(i)["question"] for i in first] == [suite.entry(i)["question"] for i in first]
    other = ReasoningGymSuite(None, seed=1, items_per_category=len(DEFAULT_DATASETS))
    assert [other.entry(i)["question"] for i in first] != [suite.entry(i)["question"] for i in first]


def test_a_limit_prefix_covers_the_four_categories(suite: ReasoningGymSuite) -> None:
    assert {i.category for i in suite.items()[:4]} == {"math", "algorithmic", "cognition", "logic"}
    assert set(PAPER_CATEGORIES.values()) == {i.category for i in suite.items()}


def test_every_attribute_is_at_its_hardest_level_only() -> None:
    config = hardest_config("basic_arithmetic", seed=5, size=3)
    assert (config.min_terms, config.max_terms) == (6, 6)  # the curriculum's last num_terms level
    assert (config.min_digits, config.max_digits) == (4, 4)
    recorded = ReasoningGymSuite(None, 0, ["basic_arithmetic"], 1).config()["datasets"]["basic_arithmetic"]
    assert recorded["category"] == "math" and recorded["max_terms"] == 6 and "seed" in recorded


def test_the_gold_answer_scores_1_wherever_the_package_gives_one(suite: ReasoningGymSuite) -> None:
    checked = 0
    for item in suite.items():
        entry = suite.entry(item)
        if entry.get("answer") is None:  # validity-scored datasets (propositional_logic) have no gold
            continue
        score, answer, error = suite.score(item, entry, f"thinking...\n<answer>{entry['answer']}</answer>")
        assert (score, error) == (1.0, ""), (item.id, answer)
        checked += 1
    assert checked >= len(DEFAULT_DATASETS) - 1


@pytest.mark.parametrize("dataset", ["basic_arithmetic", "gcd", "count_primes", "syllogism", "knights_knaves"])
def test_a_wrong_answer_scores_0(dataset: str) -> None:
    one = ReasoningGymSuite(None, 0, [dataset], 3)
    for item in one.items():
        entry = one.entry(item)
        assert one.score(item, entry, "<answer>certainly not this</answer>")[0] == 0.0
        assert one.score(item, entry, "I do not know.")[0] == 0.0  # no <answer> tag at all


def test_a_scorer_that_raises_counts_0_with_the_reason() -> None:
    one = ReasoningGymSuite(None, 0, ["prime_factorization"], 1)
    item = one.items()[0]
    score, _, error = one.score(item, one.entry(item), "<answer>seven times something</answer>")
    assert score == 0.0 and error.startswith("scorer raised ValueError")


def test_the_prompt_is_the_package_s_default_system_prompt_and_the_question(suite: ReasoningGymSuite) -> None:
    from reasoning_gym.utils import SYSTEM_PROMPTS

    entry = suite.entry(suite.items()[0])
    assert suite.messages(entry) == [
        {"role": "system", "content": SYSTEM_PROMPTS["default"]},
        {"role": "user", "content": entry["question"]},
    ]


def test_unknown_datasets_are_refused_by_name() -> None:
    with pytest.raises(SuiteConfigError, match="no dataset 'nope'"):
        ReasoningGymSuite(None, 0, ["nope"])
    with pytest.raises(SuiteConfigError, match="no curriculum"):
        ReasoningGymSuite(None, 0, ["gsm_symbolic"])


def test_the_config_names_the_package_version(suite: ReasoningGymSuite) -> None:
    config = suite.config()
    assert config["package"] == "reasoning-gym==0.1.25"
    assert set(config["datasets"]) == set(DEFAULT_DATASETS)
    assert all(dataclasses.is_dataclass(hardest_config(n, 0, 1)) for n in list(DEFAULT_DATASETS)[:3])
