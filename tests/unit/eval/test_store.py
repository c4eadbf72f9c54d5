"""The out directory: durable appends, resumption, torn writes and someone else's run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.eval.core.records import ItemResult
from services.eval.core.runner import run_items, select
from services.eval.store import ITEMS_FILE, RunStore, StoreError, read_run
from tests.unit.eval.helpers import ScriptedSuite, header, item, write_run


def test_reopening_finds_the_finished_items(tmp_path: Path) -> None:
    write_run(tmp_path, header(), [item("a", 1.0), item("b", 0.0)])
    with RunStore(tmp_path, header()) as store:
        assert store.done == {"a", "b"}
        store.append(item("c", 1.0))
    assert [i.id for i in read_run(tmp_path)[1]] == ["a", "b", "c"]


def test_a_torn_last_line_is_dropped_and_the_item_redone(tmp_path: Path) -> None:
    write_run(tmp_path, header(), [item("a", 1.0)])
    with (tmp_path / ITEMS_FILE).open("a") as fh:
        fh.write(item("b", 1.0).to_json()[:25])  # a writer killed mid-line
    with RunStore(tmp_path, header()) as store:
        assert store.done == {"a"}
        store.append(item("b", 0.0))
    lines = (tmp_path / ITEMS_FILE).read_text().splitlines()
    assert [json.loads(line)["id"] for line in lines] == ["a", "b"]


def test_another_run_s_directory_is_refused(tmp_path: Path) -> None:
    write_run(tmp_path, header(), [item("a", 1.0)])
    with pytest.raises(StoreError, match=r"another run's results \(model 'ckpt-a' vs 'ckpt-b'\)"):
        RunStore(tmp_path, header(model="ckpt-b")).open()
    with pytest.raises(StoreError, match="seed 0 vs 2"):
        RunStore(tmp_path, header(seed=2)).open()


def test_a_corrupted_line_is_named(tmp_path: Path) -> None:
    write_run(tmp_path, header(), [item("a", 1.0)])
    with (tmp_path / ITEMS_FILE).open("a") as fh:
        fh.write("not json\n")
    with pytest.raises(StoreError, match=r"items.jsonl:2 is not JSON"):
        RunStore(tmp_path, header()).open()


async def test_a_larger_limit_runs_only_the_new_items(tmp_path: Path) -> None:
    scores = {f"i{n}": float(n % 2) for n in range(6)}
    first = ScriptedSuite(scores)
    with RunStore(tmp_path, header()) as store:
        todo, done = select(first.items(), 3, store.done)
        await run_items(first, todo, store.append, concurrency=2)
    assert sorted(first.ran) == ["i0", "i1", "i2"] and done == 0
    second = ScriptedSuite(scores)
    with RunStore(tmp_path, header()) as store:
        todo, done = select(second.items(), 5, store.done)
        await run_items(second, todo, store.append, concurrency=2)
    assert sorted(second.ran) == ["i3", "i4"] and done == 3
    assert sorted(i.id for i in read_run(tmp_path)[1]) == [f"i{n}" for n in range(5)]


async def test_an_interrupted_run_keeps_its_items_and_resumes(tmp_path: Path) -> None:
    scores = {f"i{n}": 1.0 for n in range(5)}
    broken = ScriptedSuite(scores, fail_on="i3")
    with RunStore(tmp_path, header()) as store, pytest.raises(ConnectionError, match="went away"):
        await run_items(broken, broken.items(), store.append, concurrency=1)
    saved = {i.id for i in read_run(tmp_path)[1]}
    assert saved == {"i0", "i1", "i2"}  # written before the failure, durable
    healthy = ScriptedSuite(scores)
    with RunStore(tmp_path, header()) as store:
        todo, _ = select(healthy.items(), None, store.done)
        await run_items(healthy, todo, store.append, concurrency=3)
    assert sorted(healthy.ran) == ["i3", "i4"]  # the finished items were not redone
    assert len(read_run(tmp_path)[1]) == 5


async def test_concurrency_is_bounded(tmp_path: Path) -> None:
    suite = ScriptedSuite({f"i{n}": 1.0 for n in range(12)}, delay_s=0.01)
    results: list[ItemResult] = []
    await run_items(suite, suite.items(), results.append, concurrency=3)
    assert suite.max_in_flight == 3 and len(results) == 12


def test_duplicate_ids_are_a_suite_bug() -> None:
    suite = ScriptedSuite({"a": 1.0})
    with pytest.raises(ValueError, match="twice"):
        select([*suite.items(), *suite.items()], None, set())
