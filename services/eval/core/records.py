"""What an evaluation writes: one header per run, one record per item, and the summary of both.

An eval's out directory holds ``run.json`` (a :class:`RunHeader`: the suite, its seed and
configuration, the model, its weight version and the sampling settings) and ``items.jsonl`` (one
:class:`ItemResult` per line, appended as items finish). The header is the run's identity: a
resumed run must match it, and ``spade eval compare`` pairs only runs whose items are the same.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from services.eval.core.bootstrap import DEFAULT_CONFIDENCE, DEFAULT_RESAMPLES, Interval, mean_interval

FORMAT_VERSION = 1
"""Version of the on-disk layout; readers refuse others."""

OVERALL = "overall"
"""The summary's key for the mean over every item, whatever its category."""


class RecordError(ValueError):
    """A header or item that cannot be read (the message names the file, the field and the fix)."""


def prompt_hash(prompt: Any) -> str:
    """SHA-256 of a prompt's canonical JSON (messages, tools, token ids: any JSON value).

    Two runs that show a model the same prompt record the same hash, which is how ``compare`` can
    tell that paired items really are the same.

    >>> prompt_hash([{"role": "user", "content": "hi"}]) == prompt_hash([{"content": "hi", "role": "user"}])
    True
    """
    canonical = json.dumps(prompt, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class RunHeader:
    """The identity of one evaluation run.

    Attributes:
        suite: The suite's name (``reasoning-gym``, ``bfcl-multi-turn``, ``pool``).
        seed: The seed the suite's items were drawn with.
        suite_config: Everything else that decides which items exist and how they are scored.
        model: The ``--model`` argument as given (a checkpoint directory or a server URL).
        weight_version: The weight version the server reported in ``/model_info``.
        served_model: The server's model path/name from ``/model_info``.
        sampling: The sampling settings every generation used.
        format: On-disk layout version.
    """

    suite: str
    seed: int
    suite_config: dict[str, Any]
    model: str
    weight_version: str | None
    served_model: str
    sampling: dict[str, Any]
    format: int = FORMAT_VERSION

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready mapping."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "run.json") -> RunHeader:
        """Read a header; raises :class:`RecordError` naming what is wrong."""
        if data.get("format") != FORMAT_VERSION:
            raise RecordError(
                f"{source}: layout version {data.get('format')!r} is not {FORMAT_VERSION}; "
                "rerun the eval with this version of spade"
            )
        try:
            return cls(
                suite=str(data["suite"]),
                seed=int(data["seed"]),
                suite_config=dict(data["suite_config"]),
                model=str(data["model"]),
                weight_version=None if data.get("weight_version") is None else str(data["weight_version"]),
                served_model=str(data.get("served_model", "")),
                sampling=dict(data["sampling"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise RecordError(f"{source}: not an eval run header ({exc!r} missing or malformed)") from None

    def same_items(self, other: RunHeader) -> list[str]:
        """Why ``other`` does not evaluate the same items as this run (empty: it does)."""
        problems = []
        if self.suite != other.suite:
            problems.append(f"suite {self.suite!r} vs {other.suite!r}")
        if self.seed != other.seed:
            problems.append(f"seed {self.seed} vs {other.seed}")
        if self.suite_config != other.suite_config:
            keys = sorted(
                k
                for k in {*self.suite_config, *other.suite_config}
                if self.suite_config.get(k) != other.suite_config.get(k)
            )
            problems.append(f"suite settings differ in {', '.join(keys)}")
        return problems

    def same_run(self, other: RunHeader) -> list[str]:
        """Why ``other`` is not a continuation of this run (empty: it is)."""
        problems = self.same_items(other)
        if self.model != other.model:
            problems.append(f"model {self.model!r} vs {other.model!r}")
        if self.weight_version != other.weight_version:
            problems.append(f"weight version {self.weight_version!r} vs {other.weight_version!r}")
        if self.sampling != other.sampling:
            problems.append(f"sampling {self.sampling} vs {other.sampling}")
        return problems


@dataclass(frozen=True)
class ItemResult:
    """The outcome of one item.

    Attributes:
        id: The item's stable id (the same item has the same id in every run with the same seed).
        category: The category it is summarised under.
        prompt_hash: :func:`prompt_hash` of what the model was first shown.
        response: The model's replies, in order (one for a single-turn item).
        score: The benchmark's own score, in [0, 1]; 0 when the scorer raised.
        error: Why the item scored 0 without being judged (scorer raised, server refused), or "".
        detail: Suite-specific facts (the extracted answer, the gold answer, turns, finish reason).
    """

    id: str
    category: str
    prompt_hash: str
    response: tuple[str, ...]
    score: float
    error: str = ""
    detail: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0.0 <= self.score <= 1.0:
            raise RecordError(f"item {self.id}: score {self.score} lies outside [0, 1]; scores are in [0, 1]")

    def to_json(self) -> str:
        """One line of ``items.jsonl``."""
        data = asdict(self)
        data["response"] = list(self.response)
        return json.dumps(data, ensure_ascii=False, default=str)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "items.jsonl") -> ItemResult:
        """Read one item; raises :class:`RecordError` naming what is wrong."""
        try:
            response = data.get("response", ())
            return cls(
                id=str(data["id"]),
                category=str(data["category"]),
                prompt_hash=str(data.get("prompt_hash", "")),
                response=(response,) if isinstance(response, str) else tuple(str(r) for r in response),
                score=float(data["score"]),
                error=str(data.get("error") or ""),
                detail=dict(data.get("detail") or {}),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise RecordError(f"{source}: not an eval item ({exc!r} missing or malformed)") from None


@dataclass(frozen=True)
class Summary:
    """Per-category means with bootstrap intervals, and the overall mean.

    Attributes:
        header: The run.
        categories: Category name (and :data:`OVERALL`) to its interval.
        errors: Items that scored 0 because something failed rather than being judged.
    """

    header: RunHeader
    categories: dict[str, Interval]
    errors: int

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready mapping (``summary.json`` and ``--json``)."""
        return {
            "run": self.header.to_dict(),
            "categories": {name: iv.to_dict() for name, iv in self.categories.items()},
            "errors": self.errors,
        }


def summarise(
    header: RunHeader,
    items: Iterable[ItemResult],
    *,
    resamples: int = DEFAULT_RESAMPLES,
    confidence: float = DEFAULT_CONFIDENCE,
) -> Summary:
    """Means with bootstrap intervals per category and overall (categories sorted by name).

    The bootstrap generator is seeded with the run's seed, so a summary is reproducible.
    """
    by_category: dict[str, list[float]] = {}
    everything: list[float] = []
    errors = 0
    for item in items:
        by_category.setdefault(item.category, []).append(item.score)
        everything.append(item.score)
        errors += bool(item.error)
    categories = {
        name: mean_interval(scores, resamples=resamples, confidence=confidence, seed=header.seed)
        for name, scores in sorted(by_category.items())
    }
    if everything:
        categories[OVERALL] = mean_interval(everything, resamples=resamples, confidence=confidence, seed=header.seed)
    return Summary(header, categories, errors)


def order_like(items: Iterable[ItemResult], ids: Sequence[str]) -> list[ItemResult]:
    """``items`` in the order of ``ids`` (the suite's order); items not in ``ids`` are dropped."""
    by_id = {item.id: item for item in items}
    return [by_id[i] for i in ids if i in by_id]
