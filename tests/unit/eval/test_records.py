"""Run headers, item records and summaries."""

from __future__ import annotations

import doctest
import json

import pytest

from services.eval.core import records
from services.eval.core.records import OVERALL, ItemResult, RecordError, RunHeader, prompt_hash, summarise
from tests.unit.eval.helpers import header, item


def test_doctests() -> None:
    assert doctest.testmod(records).failed == 0


def test_prompt_hash_is_canonical_and_tells_prompts_apart() -> None:
    a = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
    b = [{"content": "s", "role": "system"}, {"content": "q", "role": "user"}]
    assert prompt_hash(a) == prompt_hash(b)
    assert prompt_hash(a) != prompt_hash([{"role": "user", "content": "q"}])


def test_an_item_round_trips_through_its_json_line() -> None:
    one = ItemResult("gcd/0", "math", "abc", ("<answer>4</answer>",), 1.0, "", {"gold": "4"})
    assert ItemResult.from_dict(json.loads(one.to_json())) == one


def test_a_score_outside_0_1_is_refused() -> None:
    with pytest.raises(RecordError, match=r"outside \[0, 1\]"):
        ItemResult("x", "math", "h", (), 1.5)


def test_headers_name_what_makes_two_runs_different() -> None:
    base = header()
    assert base.same_run(header()) == []
    assert base.same_items(header(model="ckpt-b", weight_version="7")) == []
    problems = base.same_run(header(model="ckpt-b", seed=4))
    assert any("seed 0 vs 4" in p for p in problems) and any("ckpt-b" in p for p in problems)
    differ = base.same_items(header(suite_config={"items_per_category": 3}))
    assert differ == ["suite settings differ in items_per_category"]


def test_a_header_of_another_layout_is_refused() -> None:
    data = header().to_dict() | {"format": 99}
    with pytest.raises(RecordError, match="layout version"):
        RunHeader.from_dict(data)


def test_the_summary_has_every_category_and_the_overall_mean() -> None:
    items = [item("a", 1.0, "math"), item("b", 0.0, "math"), item("c", 1.0, "logic")]
    errored = ItemResult("d", "logic", "h", (), 0.0, "scorer raised ValueError")
    summary = summarise(header(), [*items, errored], resamples=200)
    assert list(summary.categories) == ["logic", "math", OVERALL]
    assert summary.categories["math"].mean == 0.5 and summary.categories["math"].n == 2
    assert summary.categories[OVERALL].mean == 0.5 and summary.categories[OVERALL].n == 4
    assert summary.errors == 1
    assert json.loads(json.dumps(summary.to_dict()))["categories"]["logic"]["n"] == 2
