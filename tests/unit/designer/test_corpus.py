"""The JSONL corpus loader, seeded sampling and the offline default-corpus builder."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from services.designer.corpus.builder import (
    build_corpus,
    collect,
    ensure_default_corpus,
    is_current,
    main,
    stdlib_packages,
)
from services.designer.corpus.loader import CorpusError, CorpusSampler, load_jsonl, parse_lines


def write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_orig_doc_wins_and_other_keys_are_metadata(tmp_path: Path) -> None:
    corpus = load_jsonl(
        write(tmp_path / "c.jsonl", [json.dumps({"text": "short", "orig_doc": "the original", "id": 7, "url": "u"})])
    )
    (doc,) = corpus.documents
    assert doc.text == "the original"
    assert doc.metadata == {"id": 7, "url": "u", "line": 1}


def test_blank_bad_and_textless_lines_are_skipped_and_counted(tmp_path: Path) -> None:
    lines = [
        "",
        "{not json",
        json.dumps(["a", "list"]),
        json.dumps({"text": "   "}),
        json.dumps({"text": 5}),
        json.dumps({"title": "no text"}),
        json.dumps({"text": "kept one"}),
        "   ",
        json.dumps({"orig_doc": "", "text": "falls back to text"}),
    ]
    corpus = load_jsonl(write(tmp_path / "c.jsonl", lines))
    assert [d.text for d in corpus.documents] == ["kept one", "falls back to text"]
    assert corpus.skipped == 7


def test_an_empty_or_missing_corpus_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(CorpusError, match="no usable document"):
        load_jsonl(write(tmp_path / "empty.jsonl", ["", "{}"]))
    with pytest.raises(CorpusError, match="does not exist"):
        load_jsonl(tmp_path / "nope.jsonl")
    (tmp_path / "latin1.jsonl").write_bytes(b'{"text": "caf\xe9"}\n')
    with pytest.raises(CorpusError, match="UTF-8"):
        load_jsonl(tmp_path / "latin1.jsonl")


def test_sampling_is_seeded_and_gives_a_new_document_per_attempt() -> None:
    corpus = parse_lines([json.dumps({"text": f"doc {i}"}) for i in range(5)])
    first = [CorpusSampler(corpus, seed=3).next_document().text for _ in range(1)]
    a = CorpusSampler(corpus, seed=3)
    b = CorpusSampler(corpus, seed=3)
    seq_a = [a.next_document().text for _ in range(23)]
    seq_b = [b.next_document().text for _ in range(23)]
    assert seq_a == seq_b and seq_a[0] == first[0]
    assert sorted(seq_a[:5]) == sorted(f"doc {i}" for i in range(5))  # all drawn before any repeats
    assert all(x != y for x, y in itertools.pairwise(seq_a))  # never twice in a row
    other = CorpusSampler(corpus, seed=4)
    assert [other.next_document().text for _ in range(23)] != seq_a


@pytest.mark.slow
def test_the_builder_collects_real_docstrings_with_examples_deduped() -> None:
    entries = collect(["networkx.algorithms.clique"])
    names = [e.name for e in entries]
    assert names == sorted(names) and len(set(names)) == len(names)
    assert any(name.endswith("find_cliques") for name in names)
    assert len({e.text for e in entries}) == len(entries)
    assert all(len(e.text.split()) >= 30 for e in entries)
    assert any(">>>" in e.text for e in entries)
    assert {e.package for e in entries} == {"networkx.algorithms.clique"}


def test_the_tool_corpus_skips_modules_with_import_side_effects() -> None:
    names = stdlib_packages()
    assert "json" in names and "antigravity" not in names and "this" not in names


def test_build_writes_a_loadable_corpus_and_metadata(tmp_path: Path) -> None:
    path = build_corpus("game", tmp_path, packages=["networkx.algorithms.clique"])
    corpus = load_jsonl(path)
    assert len(corpus) > 3 and corpus.skipped == 0
    assert corpus.documents[0].metadata["package"] == "networkx.algorithms.clique"
    meta = json.loads((tmp_path / "game.meta.json").read_text())
    assert meta["documents"] == len(corpus)
    # Built from a subset, it does not pass for the default game corpus: a lazy build would redo it.
    assert not is_current("game", tmp_path)


@pytest.mark.slow
def test_the_default_tool_corpus_is_built_lazily_once(tmp_path: Path) -> None:
    path = ensure_default_corpus("tool", tmp_path)
    assert is_current("tool", tmp_path)
    corpus = load_jsonl(path)
    assert len(corpus) > 500
    assert any(str(d.metadata.get("name", "")).startswith("json.") for d in corpus.documents)
    mtime = path.stat().st_mtime_ns
    assert ensure_default_corpus("tool", tmp_path) == path
    assert path.stat().st_mtime_ns == mtime  # cached, not rebuilt
    # The builder's command (set-up runs it on every install) keeps a current corpus too: a rebuild
    # changed the warm start's cache key, which hashes the corpus, and cost a 15-minute rebuild.
    assert main(["--setting", "tool", "--cache-dir", str(tmp_path)]) == 0
    assert path.stat().st_mtime_ns == mtime
    assert main(["--setting", "tool", "--cache-dir", str(tmp_path), "--force"]) == 0
    assert path.stat().st_mtime_ns != mtime


def test_reading_a_package_s_deprecated_names_prints_no_warning() -> None:
    # scipy.constants.codata's public names are deprecated aliases: reading each used to warn, and a
    # first `make run` printed ~1,800 such lines about code this project does not use.
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        entries = collect(["scipy.constants"], min_words=5)
    assert entries and not [w for w in caught if issubclass(w.category, DeprecationWarning)]


def test_the_corpus_is_the_same_on_every_build(tmp_path: Path) -> None:
    # networkx.subgraph_view's defaults are functions: their repr carried a memory address, so every
    # build wrote other bytes (and the warm start built on the corpus was rebuilt on every install).
    entries = collect(["networkx.classes.graphviews"])
    view = next(e for e in entries if e.name.endswith("subgraph_view"))
    assert "filter_node=<function no_filter>" in view.text and " at 0x" not in view.text
