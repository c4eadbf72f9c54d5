"""Reading a pool: JSONL exports, the memory's database (SQLite and the real Postgres), held-out seeds."""

from __future__ import annotations

import doctest
import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from services.eval import pool_source
from services.eval.pool_source import PoolSourceError, held_out_seeds, load_pool, playable
from services.eval.wiring import read_memory_database
from services.memory.store.sql import SqlStore, make_engine, migrate
from services.rollout.core.seeds import play_seeds
from spade.envs.examples import EXAMPLES
from spade.envs.types import Setting
from spade.memory.records import EnvStatus, NewEnvironment, Play
from tests.conftest import POSTGRES_URL

GAME = [e for e in EXAMPLES.values() if str(getattr(e.setting, "value", e.setting)) == "game"]


def test_doctests() -> None:
    assert doctest.testmod(pool_source).failed == 0


def test_held_out_seeds_are_stable_distinct_and_skip_played_ones() -> None:
    seeds = held_out_seeds("env-1", 0, 50)
    assert seeds == held_out_seeds("env-1", 0, 50) and len(set(seeds)) == 50
    assert all(0 <= s < 2**31 for s in seeds)
    skipped = held_out_seeds("env-1", 0, 3, exclude=frozenset(seeds[:2]))
    assert skipped[0] == seeds[2] and not set(skipped) & set(seeds[:2])
    training = {s for v in range(100) for s in play_seeds("env-1", v, 16)}
    assert not training & set(seeds)  # independent of the rollout's seeds


def test_a_jsonl_export_is_read_in_order(tmp_path: Path) -> None:
    path = tmp_path / "envs.jsonl"
    rows = [
        {"env_id": "a", "setting": "game", "skill": "Logic", "status": "valid", "code": "x", "hint": "h"},
        {"id": "b", "setting": "tool", "status": "invalid", "code": "y"},  # `spade envs export` names it id
        {"env_id": "c", "setting": "game", "status": "retired", "code": "z"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    envs = load_pool(str(path), read_memory_database)
    assert [e.env_id for e in envs] == ["a", "b", "c"] and envs[1].skill == "unknown"
    assert [e.env_id for e in playable(envs)] == ["a", "c"]
    assert [e.env_id for e in playable(envs, "tool")] == []
    assert load_pool(str(tmp_path), read_memory_database)[0].env_id == "a"  # a run directory: its envs.jsonl


@pytest.mark.parametrize(
    ("content", "why"),
    [
        ("{not json\n", "is not JSON"),
        ('{"setting": "game", "code": "x"}\n', "'env_id'"),
        ("[1]\n", "not a JSON object"),
    ],
)
def test_a_bad_export_is_named(tmp_path: Path, content: str, why: str) -> None:
    path = tmp_path / "envs.jsonl"
    path.write_text(content)
    with pytest.raises(PoolSourceError, match=why):
        load_pool(str(path), read_memory_database)


def test_missing_sources_are_named(tmp_path: Path) -> None:
    with pytest.raises(PoolSourceError, match="no pool at"):
        load_pool(str(tmp_path / "nope.jsonl"), read_memory_database)
    with pytest.raises(PoolSourceError, match=r"neither memory\.db nor envs\.jsonl"):
        load_pool(str(tmp_path), read_memory_database)
    with pytest.raises(PoolSourceError, match="no memory database"):
        load_pool(f"sqlite:///{tmp_path / 'none.db'}", read_memory_database)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.db)])
def memory_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'memory.db'}"
        return
    schema = f"t_{uuid.uuid4().hex[:16]}"
    admin = create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(text(f'CREATE SCHEMA "{schema}"'))
    try:
        yield f"{POSTGRES_URL}?options=-csearch_path%3D{schema}"
    finally:
        with admin.connect() as c:
            c.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


def test_the_memory_database_gives_envs_and_the_seeds_already_played(memory_url: str) -> None:
    engine = make_engine(memory_url)
    migrate(engine)
    store = SqlStore(engine)
    first = store.put_environment(NewEnvironment(setting=Setting.GAME, skill="Logic", code=GAME[0].code)).env_id
    second = store.put_environment(NewEnvironment(setting=Setting.GAME, skill="Search", code=GAME[1].code)).env_id
    store.put_environment(NewEnvironment(setting=Setting.GAME, skill="x", code="broken", status=EnvStatus.INVALID))
    store.record_plays([Play(first, s, False, 1.0, 2, 0, f"t{s}") for s in (11, 12, 13)])
    engine.dispose()
    envs = load_pool(memory_url, read_memory_database)
    assert [e.env_id for e in playable(envs)] == [first, second]  # oldest first, invalid left out
    assert envs[0].played_seeds == frozenset({11, 12, 13}) and envs[1].played_seeds == frozenset()
    assert envs[0].code == GAME[0].code and envs[0].skill == "Logic"
