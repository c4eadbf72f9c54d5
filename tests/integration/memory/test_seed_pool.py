"""The seed pool: example envs stored once and announced once, however often it is loaded."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from services.memory.seed_pool import SeedPoolError, seed_pool
from services.memory.service import MemoryService
from services.memory.store.sql import SqlStore, make_engine, migrate
from spade.envs.examples import EXAMPLES
from spade.queues.base import ENVS_READY
from spade.queues.inprocess import InProcessQueue
from spade.queues.messages import decode


def _memory(tmp_path: Path) -> MemoryService:
    engine = make_engine(f"sqlite:///{tmp_path / 'memory.db'}")
    migrate(engine)
    return MemoryService(SqlStore(engine))


async def test_seeding_twice_stores_and_announces_each_example_once(tmp_path: Path) -> None:
    memory, queue = _memory(tmp_path), InProcessQueue()
    first = await seed_pool("game", memory, queue, window_versions=5)
    again = await seed_pool("game", memory, queue, window_versions=5)
    games = sorted(n for n, e in EXAMPLES.items() if e.setting.value == "game")
    assert len(first) == len(games) and sorted(first) == sorted(again)
    delivered = await queue.consume(ENVS_READY, "rollout", "w", count=100, block_ms=1)
    assert len(delivered) == len(games)
    messages = [decode(d) for d in delivered]
    assert {m.env_id for m in messages} == set(first)  # type: ignore[attr-defined]
    assert all(m.window_versions == 5 and m.weight_version == 0 for m in messages)  # type: ignore[attr-defined]
    stored = await memory.get_environment(first[0])
    assert stored.corpus_ref.startswith("seed pool") and stored.hint


async def test_names_filter_and_unknown_names(tmp_path: Path) -> None:
    memory, queue = _memory(tmp_path), InProcessQueue()
    assert len(await seed_pool("game", memory, queue, names=["number_hunt"])) == 1
    with pytest.raises(SeedPoolError, match="no example env named"):
        await seed_pool("game", memory, queue, names=["chess"])


async def test_an_example_that_fails_validation_is_refused(tmp_path: Path) -> None:
    async def failing(code: str, setting: str) -> SimpleNamespace:
        check = SimpleNamespace(name="solution_replay", passed=False, detail="lost")
        return SimpleNamespace(valid=False, checks=[check])

    with pytest.raises(SeedPoolError, match="solution_replay"):
        await seed_pool("tool", _memory(tmp_path), InProcessQueue(), validate=failing)
