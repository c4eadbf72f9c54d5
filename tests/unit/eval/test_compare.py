"""Pairing two runs item by item, and the refusals when they cannot be paired."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from services.eval.cli import eval_group
from services.eval.core.bootstrap import paired_difference
from services.eval.core.compare import CompareError, compare
from services.eval.core.records import OVERALL
from services.eval.store import read_run
from tests.unit.eval.helpers import header, item, write_run

A_SCORES = {"a": 0.0, "b": 1.0, "c": 0.0, "d": 0.0, "e": 1.0, "f": 0.0}
B_SCORES = {"a": 1.0, "b": 1.0, "c": 1.0, "d": 0.0, "e": 1.0, "f": 1.0}


def _runs(tmp_path: Path, **b_changes: object) -> tuple[Path, Path]:
    cats = {k: ("math" if k in "abc" else "logic") for k in A_SCORES}
    a = write_run(tmp_path / "a", header(), [item(k, v, cats[k]) for k, v in A_SCORES.items()])
    b_items = [item(k, v, cats[k]) for k, v in B_SCORES.items() if k != "f"] + [item("g", 1.0, "logic")]
    b = write_run(tmp_path / "b", header(model="ckpt-b", weight_version="9", **b_changes), b_items)
    return a, b


def test_paired_difference_per_category_and_overall(tmp_path: Path) -> None:
    a, b = _runs(tmp_path)
    result = compare(read_run(a), read_run(b), resamples=500)
    common = ["a", "b", "c", "d", "e"]
    expected = paired_difference([A_SCORES[k] for k in common], [B_SCORES[k] for k in common], resamples=500)
    assert result.differences[OVERALL] == expected
    assert result.paired == 5 and result.only_a == ["f"] and result.only_b == ["g"]
    assert result.means["math"] == (pytest.approx(1 / 3), 1.0)
    assert result.differences["math"].mean == pytest.approx(2 / 3)
    assert result.differences["logic"].mean == 0.0


def test_the_interval_does_not_depend_on_the_order_items_finished_in(tmp_path: Path) -> None:
    # Two embedded runs with the same scores once gave [+0.000, +0.234] and [+0.030, +0.229]: the "before"
    # eval had written two items in the other order, and the report's verdict flipped with it.
    scores = {"a": 0.2, "b": 0.0, "c": 0.0, "d": 0.1, "e": 0.0, "f": 0.4, "g": 0.0, "h": 0.0}
    after = {"a": 0.7, "b": 0.0, "c": 0.5, "d": 0.1, "e": 0.0, "f": 0.7, "g": 0.0, "h": 0.3}
    b = write_run(tmp_path / "b", header(model="ckpt-b"), [item(k, v) for k, v in after.items()])
    intervals = []
    for name, order in (("a1", "abcdefgh"), ("a2", "hgfedcba"), ("a3", "cadbfehg")):
        a = write_run(tmp_path / name, header(), [item(k, scores[k]) for k in order])
        intervals.append(compare(read_run(a), read_run(b), resamples=500).differences[OVERALL])
    assert intervals[0] == intervals[1] == intervals[2]


@pytest.mark.parametrize(
    ("change", "why"),
    [({"seed": 1}, "seed 0 vs 1"), ({"suite": "pool"}, "suite 'reasoning-gym' vs 'pool'")],
)
def test_runs_of_other_items_are_refused(tmp_path: Path, change: dict[str, object], why: str) -> None:
    a, b = _runs(tmp_path, **change)
    with pytest.raises(CompareError, match=why):
        compare(read_run(a), read_run(b))


def test_runs_without_a_common_item_are_refused(tmp_path: Path) -> None:
    a = write_run(tmp_path / "a", header(), [item("a", 1.0)])
    b = write_run(tmp_path / "b", header(), [item("z", 1.0)])
    with pytest.raises(CompareError, match="no item in common"):
        compare(read_run(a), read_run(b))


def test_a_paired_item_shown_another_prompt_is_refused(tmp_path: Path) -> None:
    a = write_run(tmp_path / "a", header(), [item("a", 1.0, prompt="2+2?")])
    b = write_run(tmp_path / "b", header(), [item("a", 0.0, prompt="2+3?")])
    with pytest.raises(CompareError, match="different prompts"):
        compare(read_run(a), read_run(b))


def test_different_sampling_is_noted_not_refused(tmp_path: Path) -> None:
    a, b = _runs(tmp_path, sampling={"temperature": 0.0, "top_p": 1.0, "max_new_tokens": 32})
    assert any("sampling differs" in n for n in compare(read_run(a), read_run(b)).notes)


def test_the_command_prints_the_table_and_json(tmp_path: Path) -> None:
    a, b = _runs(tmp_path)
    out = CliRunner().invoke(eval_group, ["compare", str(a), str(b)])
    assert out.exit_code == 0, out.output
    assert "5 paired items" in out.output and "overall" in out.output and "+0.400" in out.output
    as_json = CliRunner().invoke(eval_group, ["compare", str(a), str(b / "items.jsonl"), "--json"])
    data = json.loads(as_json.output)
    assert data["paired"] == 5 and data["categories"]["overall"]["difference"]["mean"] == pytest.approx(0.4)


def test_the_command_refuses_in_one_line(tmp_path: Path) -> None:
    a, b = _runs(tmp_path, seed=5)
    out = CliRunner().invoke(eval_group, ["compare", str(a), str(b)])
    assert out.exit_code == 1
    assert out.output.count("\n") == 1 and "seed 0 vs 5" in out.output and "Traceback" not in out.output
    missing = CliRunner().invoke(eval_group, ["compare", str(a), str(tmp_path / "nope")])
    assert missing.exit_code == 1 and "holds no eval run" in missing.output
