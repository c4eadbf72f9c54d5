"""An eval's out directory: ``run.json``, ``items.jsonl`` appended per item, ``summary.json``.

Resumption: opening a directory that already holds a run checks that the header matches (same
suite, seed, settings, model, weights and sampling), reads the items finished so far and drops a
torn last line left by a writer that was killed mid-write, so the rerun continues where it stopped
and never scores an item twice. Each item is flushed and fsynced as it is written.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from services.eval.core.records import ItemResult, RecordError, RunHeader, Summary

HEADER_FILE = "run.json"
ITEMS_FILE = "items.jsonl"
SUMMARY_FILE = "summary.json"


class StoreError(RuntimeError):
    """The out directory cannot be used (another run's results, unreadable files)."""


def _write_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, ensure_ascii=False, default=str) + "\n")
    os.replace(tmp, path)


def _read_items(path: Path) -> tuple[list[ItemResult], int]:
    """Items in ``path`` and the byte length of its complete lines (a torn tail is not counted)."""
    if not path.exists():
        return [], 0
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1  # everything after the last newline is a torn write
    items: list[ItemResult] = []
    for number, line in enumerate(data[:end].splitlines(), start=1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as exc:
            raise StoreError(
                f"{path}:{number} is not JSON ({exc.msg}); the file was edited or corrupted: "
                "fix or delete that line, or use another --out"
            ) from None
        items.append(ItemResult.from_dict(raw, source=f"{path}:{number}"))
    return items, end


def read_run(location: Path) -> tuple[RunHeader, list[ItemResult]]:
    """Read a finished or partial run from its out directory (or its ``items.jsonl``/``run.json``).

    Raises:
        StoreError: No run there, or its files are unreadable.
    """
    directory = location.parent if location.is_file() else location
    header_path = directory / HEADER_FILE
    if not header_path.is_file():
        raise StoreError(f"{location} holds no eval run (no {HEADER_FILE}); pass the --out directory of `spade eval`")
    try:
        header = RunHeader.from_dict(json.loads(header_path.read_text()), source=str(header_path))
        items, _ = _read_items(directory / ITEMS_FILE)
    except (OSError, json.JSONDecodeError, RecordError) as exc:
        raise StoreError(str(exc)) from None
    last: dict[str, ItemResult] = {item.id: item for item in items}  # a duplicated id: the last one wins
    return header, list(last.values())


class RunStore:
    """The out directory of one run, open for appending items.

    Args:
        directory: The out directory (created if missing).
        header: This run's identity; must match a header already there.
    """

    def __init__(self, directory: Path, header: RunHeader) -> None:
        self.directory = directory
        self.header = header
        self.items: list[ItemResult] = []
        self._fh: IO[str] | None = None

    def open(self) -> RunStore:
        """Check or write the header, load finished items, truncate a torn tail, open for append.

        Raises:
            StoreError: The directory holds another run's results.
        """
        d = self.directory
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create the out directory {d}: {exc.strerror or exc}") from None
        header_path = d / HEADER_FILE
        items_path = d / ITEMS_FILE
        if header_path.exists():
            try:
                existing = RunHeader.from_dict(json.loads(header_path.read_text()), source=str(header_path))
            except (OSError, json.JSONDecodeError, RecordError) as exc:
                raise StoreError(f"{header_path} is unreadable ({exc}); use another --out") from None
            problems = existing.same_run(self.header)
            if problems:
                raise StoreError(
                    f"{d} holds another run's results (" + "; ".join(problems) + "); use another --out "
                    "or delete the directory to start over"
                )
        else:
            _write_atomic(header_path, self.header.to_dict())
        try:
            self.items, complete = _read_items(items_path)
        except RecordError as exc:
            raise StoreError(str(exc)) from None
        if items_path.exists() and items_path.stat().st_size != complete:
            with items_path.open("r+b") as fh:  # drop the torn line a killed writer left
                fh.truncate(complete)
        self._fh = items_path.open("a", encoding="utf-8")
        return self

    @property
    def done(self) -> set[str]:
        """Ids of the finished items."""
        return {item.id for item in self.items}

    def append(self, item: ItemResult) -> None:
        """Write one finished item durably."""
        if self._fh is None:
            raise StoreError("the run store is not open; call open() first")
        self._fh.write(item.to_json() + "\n")
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self.items.append(item)

    def write_summary(self, summary: Summary) -> Path:
        """Write ``summary.json``; returns its path."""
        path = self.directory / SUMMARY_FILE
        _write_atomic(path, summary.to_dict())
        return path

    def close(self) -> None:
        """Close the items file."""
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def __enter__(self) -> RunStore:
        return self.open()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
