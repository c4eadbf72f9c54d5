"""Pairing two evaluation runs item by item and the paired difference of their scores.

Two runs can be compared only when they evaluated the same items: the same suite, the same seed and
the same suite settings. Items are then paired by id; an id present in one run only (a run cut
short by ``--limit``) is left out and counted. A paired item whose prompt hash differs means the two
runs did not show the model the same thing (a changed package or prompt), which is refused too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from services.eval.core.bootstrap import DEFAULT_CONFIDENCE, DEFAULT_RESAMPLES, Interval, paired_difference
from services.eval.core.records import OVERALL, ItemResult, RunHeader


class CompareError(ValueError):
    """The two runs cannot be paired (the message says why and what to do)."""


@dataclass(frozen=True)
class Comparison:
    """``b - a`` per category and overall, with paired bootstrap intervals.

    Attributes:
        a: The baseline run.
        b: The run compared against it.
        differences: Category (and :data:`OVERALL`) to the interval of the mean of ``b - a``.
        means: Category to ``(mean of a, mean of b)`` over the paired items.
        paired: Items present in both runs.
        only_a: Ids present only in ``a``.
        only_b: Ids present only in ``b``.
        notes: Differences worth knowing that do not prevent pairing (sampling settings).
    """

    a: RunHeader
    b: RunHeader
    differences: dict[str, Interval]
    means: dict[str, tuple[float, float]]
    paired: int
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready mapping."""
        return {
            "a": self.a.to_dict(),
            "b": self.b.to_dict(),
            "paired": self.paired,
            "only_a": len(self.only_a),
            "only_b": len(self.only_b),
            "notes": list(self.notes),
            "categories": {
                name: {"mean_a": self.means[name][0], "mean_b": self.means[name][1], "difference": iv.to_dict()}
                for name, iv in self.differences.items()
            },
        }


def compare(
    a: tuple[RunHeader, Sequence[ItemResult]],
    b: tuple[RunHeader, Sequence[ItemResult]],
    *,
    resamples: int = DEFAULT_RESAMPLES,
    confidence: float = DEFAULT_CONFIDENCE,
) -> Comparison:
    """Pair ``a`` and ``b`` by item id and report ``b - a`` with paired bootstrap intervals.

    Raises:
        CompareError: Different suites, seeds or suite settings; no item in common; or a paired
            item whose prompt differs between the runs.
    """
    (header_a, items_a), (header_b, items_b) = a, b
    problems = header_a.same_items(header_b)
    if problems:
        raise CompareError(
            "the two runs did not evaluate the same items (" + "; ".join(problems) + "); "
            "compare runs of one suite with the same --seed and settings"
        )
    by_id_a = {item.id: item for item in items_a}
    by_id_b = {item.id: item for item in items_b}
    # In item-id order, not the files' (an eval writes items as they finish): the bootstrap resamples by
    # position, so the same scores must always sit in the same places to give the same interval.
    common = sorted(i for i in by_id_a if i in by_id_b)
    if not common:
        raise CompareError(
            f"the runs have no item in common ({len(by_id_a)} and {len(by_id_b)} items); "
            "were they written by the same suite and seed?"
        )
    changed = [i for i in common if by_id_a[i].prompt_hash != by_id_b[i].prompt_hash]
    if changed:
        raise CompareError(
            f"{len(changed)} paired items were shown different prompts (first: {changed[0]}); the suite's "
            "package or prompts changed between the runs, so they cannot be paired: rerun both"
        )
    by_category: dict[str, tuple[list[float], list[float]]] = {}
    for i in common:
        scores = by_category.setdefault(by_id_a[i].category, ([], []))
        scores[0].append(by_id_a[i].score)
        scores[1].append(by_id_b[i].score)
    groups = dict(sorted(by_category.items()))
    groups[OVERALL] = ([by_id_a[i].score for i in common], [by_id_b[i].score for i in common])
    differences = {
        name: paired_difference(sa, sb, resamples=resamples, confidence=confidence, seed=header_a.seed)
        for name, (sa, sb) in groups.items()
    }
    means = {name: (sum(sa) / len(sa), sum(sb) / len(sb)) for name, (sa, sb) in groups.items()}
    notes = []
    if header_a.sampling != header_b.sampling:
        notes.append(f"sampling differs: {header_a.sampling} vs {header_b.sampling}")
    return Comparison(
        a=header_a,
        b=header_b,
        differences=differences,
        means=means,
        paired=len(common),
        only_a=[i for i in by_id_a if i not in by_id_b],
        only_b=[i for i in by_id_b if i not in by_id_a],
        notes=notes,
    )
