"""The pool's process metrics without a model: Vendi over given embeddings, counts, leakage rules."""

from __future__ import annotations

import doctest
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pytest

from spade import pool_metrics as pm


def test_doctests() -> None:
    assert doctest.testmod(pm).failed == 0


class TableEmbedder:
    """Embeds each text as the vector the test gives it."""

    def __init__(self, table: dict[str, list[float]]) -> None:
        self.table = table

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        return np.array([self.table[t] for t in texts], dtype=float)


def test_identical_envs_give_1_over_n() -> None:
    embedder = TableEmbedder({"same": [0.3, 0.4, 0.5]})
    for n in (1, 2, 5, 10):
        assert pm.vendi_per_n(["same"] * n, embedder) == pytest.approx(1.0 / n)


def test_orthogonal_envs_give_1_and_similar_ones_less() -> None:
    basis = {f"e{i}": list(np.eye(6)[i]) for i in range(6)}
    assert pm.vendi_per_n(list(basis), TableEmbedder(basis)) == pytest.approx(1.0)
    close = {"a": [1.0, 0.1, 0.0], "b": [1.0, 0.0, 0.1], "c": [0.0, 0.0, 1.0]}
    value = pm.vendi_per_n(list(close), TableEmbedder(close))
    assert value is not None and 1 / 3 < value < 1.0


def test_vendi_is_the_authors_library_on_cosine_similarity() -> None:
    from vendi_score import vendi

    x = np.random.default_rng(0).normal(size=(7, 5))
    unit = x / np.linalg.norm(x, axis=1, keepdims=True)
    with pytest.warns(DeprecationWarning):  # the library names scipy.sparse.csr; pool_metrics silences it
        expected = float(vendi.score_K(unit @ unit.T))
    assert pm.vendi_score(x) == pytest.approx(expected)


def test_the_window_keeps_the_newest_envs() -> None:
    table = {"old": [1.0, 0.0], "new": [0.0, 1.0]}
    assert pm.vendi_per_n(["old", "new", "new", "new"], TableEmbedder(table), window=2) == pytest.approx(0.5)
    assert pm.vendi_per_n([], TableEmbedder(table)) is None
    with pytest.raises(ValueError, match="window"):
        pm.windowed([1], 0)


def test_bad_embeddings_are_refused() -> None:
    with pytest.raises(ValueError, match="all zeros"):
        pm.vendi_score(np.zeros((2, 3)))
    with pytest.raises(ValueError, match="non-empty"):
        pm.vendi_score(np.zeros((0, 3)))


def test_counts_of_distinct_things() -> None:
    assert pm.hash_distinct(["a = 1", "a = 1", "b = 2"]) == 2
    assert pm.distinct_documents(["doc-1", "", "doc-1", "doc-2"]) == 2
    assert pm.reward_levels([0.0, 1.0, 1.0000000001, 0.25]) == 3
    assert pm.reward_levels([]) == 0
    assert pm.interaction_turns([2, 3, 7]) == 4.0 and pm.interaction_turns([]) is None
    code = "import x\n\n   # c\nclass A:\n    pass\n"
    assert pm.program_length(code) == pm.ProgramLength(lines=3, chars=len(code))
    assert pm.learnable_fraction([0.1, 0.5, 0.8, 0.9]) == 0.5
    assert pm.env_description("code", "obs").startswith("code") and "obs" in pm.env_description("code", "obs")


LEAKY = [
    ("Guess my secret number from 1 to 50. (Psst: the secret number is 37.)", [r"\boxed{37}"], "answer-cue"),
    ("Find the total weight. The answer = 128 kg.", [r"\boxed{128}"], "answer-cue"),
    ("Unscramble TENALP into a planet's name. It is PLANET, of course.", [r"\boxed{PLANET}"], "verbatim"),
    ("Compute the 10th triangular number. The formula is n*(n+1)/2.", [r"\boxed{55}"], "formula"),
    ("Open the lock. Code: 4 1 3 2.", [r"\boxed{4 1 3 2}"], "answer-cue"),
]
CLEAN = [
    ("I picked a whole number from 1 to 40. You have 3 guesses.", [r"\boxed{16}"]),
    ("Compute 12 * 7 and answer with \\boxed{N}.", [r"\boxed{84}"]),
    ("You are in a 6x6 maze; you can move left, right, up or down.", [r"\boxed{move left}", r"\boxed{move up}"]),
    ("The answer is a 3-digit number whose digits sum to 12.", [r"\boxed{345}"]),
    ("Target: reach 100 by adding 3s and 7s. Value so far: 1000 points possible.", [r"\boxed{100}"]),
]


@pytest.mark.parametrize(("observation", "solution", "rule"), LEAKY)
def test_observations_that_state_the_answer_or_formula_leak(observation: str, solution: list[str], rule: str) -> None:
    verdict = pm.leaks_answer(observation, solution)
    assert verdict.leaked and verdict.rule == rule, verdict


@pytest.mark.parametrize(("observation", "solution"), CLEAN)
def test_observations_that_only_pose_the_task_do_not_leak(observation: str, solution: list[str]) -> None:
    assert not pm.leaks_answer(observation, solution).leaked


def test_the_leakage_share_skips_envs_without_a_verdict() -> None:
    verdicts = [pm.leaks_answer(o, s) for o, s, _ in LEAKY[:2]] + [pm.leaks_answer(*CLEAN[0]), None]
    assert pm.leakage_share(verdicts) == pytest.approx(2 / 3)
    assert pm.leakage_share([None]) is None


class ScriptedJudge:
    def __init__(self, text: str) -> None:
        self.text = text
        self.prompts: list[str] = []

    async def reply(self, messages: Sequence[Mapping[str, Any]], *, key: str, turn: int = 0) -> Any:
        self.prompts.append(messages[-1]["content"])
        return type("Reply", (), {"text": self.text})()


@pytest.mark.parametrize(("text", "verdict"), [("YES.", True), ("no", False), ("Maybe", None), ("", None)])
async def test_the_llm_judge_reads_yes_or_no(text: str, verdict: bool | None) -> None:
    judge = ScriptedJudge(text)
    assert await pm.judge_leakage(judge, "The secret is 4.", [r"\boxed{4}"], key="env-1") is verdict
    assert "The secret is 4." in judge.prompts[0] and "Winning answer: 4" in judge.prompts[0]
