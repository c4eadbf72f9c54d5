"""The evaluation loop: run a suite's items that are not done yet, a bounded number at a time.

A suite (``services/eval/suites/``) lists its items in a fixed order for its seed and runs one item
to an :class:`ItemResult`; the loop knows nothing else about it. Each finished item goes to the sink
at once (the store appends it to ``items.jsonl``), so a killed eval loses only the items in flight.

An item whose *scorer* fails is the suite's business (it records a 0 with the error). Anything a
suite raises is an infrastructure failure (the server went away, the sandbox broke): the loop stops,
the finished items stay written, and rerunning the same command resumes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from services.eval.core.records import ItemResult


@dataclass(frozen=True)
class EvalItem:
    """One item of a suite.

    Attributes:
        id: Stable id: the same seed and settings give the same ids in every run.
        category: What the item is summarised under.
        payload: Whatever the suite needs to run it (a dataset entry, a test entry, an env seed).
    """

    id: str
    category: str
    payload: Any = None


class Suite(Protocol):
    """A benchmark as the loop sees it."""

    name: str

    def config(self) -> dict[str, Any]:
        """Everything besides the seed that decides which items exist and how they are scored."""
        ...

    def items(self) -> Sequence[EvalItem]:
        """Every item, in a fixed order (a ``--limit`` takes a prefix, so mix categories early)."""
        ...

    async def run(self, item: EvalItem) -> ItemResult:
        """Generate and score one item (scorer failures score 0 with ``error`` set)."""
        ...


def select(items: Sequence[EvalItem], limit: int | None, done: Collection[str]) -> tuple[list[EvalItem], int]:
    """The items still to run: the first ``limit`` items (all when ``None``) minus those in ``done``.

    Returns:
        ``(todo, already_done)`` where ``already_done`` counts the selected items found in ``done``.

    Raises:
        ValueError: Two items share an id (a suite bug that would corrupt resumption).
    """
    seen: set[str] = set()
    for item in items:
        if item.id in seen:
            raise ValueError(f"the suite lists item id {item.id!r} twice; item ids must be unique")
        seen.add(item.id)
    chosen = list(items if limit is None else items[:limit])
    todo = [item for item in chosen if item.id not in done]
    return todo, len(chosen) - len(todo)


async def run_items(
    suite: Suite,
    todo: Sequence[EvalItem],
    sink: Callable[[ItemResult], None],
    *,
    concurrency: int,
    on_done: Callable[[ItemResult], None] | None = None,
) -> list[ItemResult]:
    """Run ``todo`` with at most ``concurrency`` items in flight; ``sink`` gets each result as it ends.

    Raises:
        Exception: The first infrastructure failure of any item (the others are cancelled).
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    gate = asyncio.Semaphore(concurrency)
    results: list[ItemResult] = []

    async def one(item: EvalItem) -> None:
        async with gate:
            result = await suite.run(item)
        if result.id != item.id:
            raise RuntimeError(f"suite {suite.name} answered item {item.id!r} with a result for {result.id!r}")
        sink(result)
        results.append(result)
        if on_done is not None:
            on_done(result)

    try:
        async with asyncio.TaskGroup() as group:
            for item in todo:
                group.create_task(one(item))
    except BaseExceptionGroup as eg:
        # One failure cancels the rest; re-raise it as itself so callers see a plain exception.
        first = eg.exceptions[0]
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        raise first from None
    return results
