"""Hand-made eval runs for the unit tests: headers, items and a scripted suite."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from services.eval.core.records import ItemResult, RunHeader, prompt_hash
from services.eval.core.runner import EvalItem
from services.eval.store import RunStore


def header(**changes: Any) -> RunHeader:
    base: dict[str, Any] = {
        "suite": "reasoning-gym",
        "seed": 0,
        "suite_config": {"items_per_category": 2},
        "model": "ckpt-a",
        "weight_version": "1",
        "served_model": "/models/a",
        "sampling": {"temperature": 0.6, "top_p": 1.0, "max_new_tokens": 32},
    }
    base.update(changes)
    return RunHeader(**base)


def item(item_id: str, score: float, category: str = "math", prompt: str | None = None) -> ItemResult:
    return ItemResult(item_id, category, prompt_hash(prompt or item_id), (f"reply to {item_id}",), score)


def write_run(directory: Path, run_header: RunHeader, items: Sequence[ItemResult]) -> Path:
    with RunStore(directory, run_header) as store:
        for one in items:
            store.append(one)
    return directory


class ScriptedSuite:
    """A suite whose items score what the script says; records every item it runs."""

    name = "reasoning-gym"

    def __init__(self, scores: dict[str, float], *, fail_on: str | None = None, delay_s: float = 0.0) -> None:
        self.scores = scores
        self.fail_on = fail_on
        self.delay_s = delay_s
        self.ran: list[str] = []
        self.in_flight = 0
        self.max_in_flight = 0

    def config(self) -> dict[str, Any]:
        return {"items_per_category": 2}

    def items(self) -> list[EvalItem]:
        return [EvalItem(i, "math" if n % 2 == 0 else "logic", i) for n, i in enumerate(self.scores)]

    async def run(self, one: EvalItem) -> ItemResult:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay_s)
            if one.id == self.fail_on:
                raise ConnectionError(f"the server went away during {one.id}")
            self.ran.append(one.id)
            return ItemResult(one.id, one.category, prompt_hash(one.id), ("r",), self.scores[one.id])
        finally:
            self.in_flight -= 1
