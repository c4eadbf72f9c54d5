"""Load a JSONL corpus and sample a new document for every designer attempt.

Each line is a JSON object. The document text comes from ``orig_doc`` (which wins) or ``text``; every
other key is kept as metadata, stored with the environment for lineage and never shown to the model.
Blank lines, unparseable lines, non-objects and lines without a non-empty text are skipped and
counted. A corpus with no usable document is an error, not an empty prompt.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

TEXT_KEYS = ("orig_doc", "text")


class CorpusError(ValueError):
    """The corpus file is missing, unreadable or holds no usable document."""


@dataclass(frozen=True)
class Document:
    """One corpus document.

    Attributes:
        text: What the designer sees (truncated by the prompt builder).
        metadata: Every other key of the JSONL line, plus ``line`` (1-based); never shown to the model.
    """

    text: str
    metadata: dict[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class Corpus:
    """A loaded corpus.

    Attributes:
        documents: The usable documents, in file order.
        skipped: Number of lines skipped (blank, bad JSON, not an object, no text).
        path: Where it was loaded from.
    """

    documents: tuple[Document, ...]
    skipped: int
    path: Path | None = None

    def __len__(self) -> int:
        return len(self.documents)


def parse_lines(lines: Iterable[str], *, source: str = "<corpus>") -> Corpus:
    """Parse JSONL ``lines`` into a corpus.

    Raises:
        CorpusError: No line holds a usable document.
    """
    documents: list[Document] = []
    skipped = 0
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            skipped += 1
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            skipped += 1
            continue
        if not isinstance(row, dict):
            skipped += 1
            continue
        text = next((row[key] for key in TEXT_KEYS if isinstance(row.get(key), str) and row[key].strip()), None)
        if text is None:
            skipped += 1
            continue
        metadata: dict[str, object] = {k: v for k, v in row.items() if k not in TEXT_KEYS}
        metadata["line"] = number
        documents.append(Document(text=text, metadata=metadata))
    if not documents:
        raise CorpusError(
            f"corpus {source} has no usable document ({skipped} lines skipped): each line must be a JSON "
            "object with a non-empty 'text' or 'orig_doc' string"
        )
    return Corpus(documents=tuple(documents), skipped=skipped)


def load_jsonl(path: str | Path) -> Corpus:
    """Load a JSONL corpus file.

    Raises:
        CorpusError: The file does not exist, is not UTF-8, or has no usable document.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise CorpusError(f"corpus file {path} does not exist: pass an existing JSONL file")
    try:
        with path.open(encoding="utf-8") as handle:
            corpus = parse_lines(handle, source=str(path))
    except UnicodeDecodeError as error:
        raise CorpusError(f"corpus file {path} is not UTF-8 ({error.reason}): re-encode it as UTF-8") from None
    return Corpus(documents=corpus.documents, skipped=corpus.skipped, path=path)


class CorpusSampler:
    """Seeded sampling of a new document per attempt.

    Documents are drawn without replacement in a seeded shuffled order; when every document has been
    drawn, a new shuffle starts. The same seed gives the same sequence.

    Args:
        corpus: The documents.
        seed: Sampling seed.
    """

    def __init__(self, corpus: Corpus, *, seed: int = 0) -> None:
        if not corpus.documents:
            raise CorpusError("cannot sample from an empty corpus")
        self._documents = corpus.documents
        self._rng = random.Random(seed)
        self._order: list[int] = []
        self._last: int | None = None

    def next_document(self) -> Document:
        """The next document (never the same one twice in a row unless the corpus has one document)."""
        if not self._order:
            order = list(range(len(self._documents)))
            self._rng.shuffle(order)
            if len(order) > 1 and order[0] == self._last:
                order[0], order[-1] = order[-1], order[0]
            self._order = order[::-1]
        self._last = self._order.pop()
        return self._documents[self._last]
