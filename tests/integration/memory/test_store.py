"""The SQL store on both databases: migrations, dedup, pagination, filters, plays and statistics."""

from __future__ import annotations

import threading

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import Engine, inspect, text

from services.memory.core.scoring import ScoringConfig
from services.memory.store.models import Base
from services.memory.store.sql import SqlStore, migrate
from spade.memory.errors import EnvironmentNotFound, InvalidArgument
from spade.memory.records import EnvFilter, EnvStatus, NewEnvironment, Play, StatsUpdate
from tests.integration.memory.conftest import env_code, new_env


@pytest.fixture
def store(empty_engine: Engine) -> SqlStore:
    migrate(empty_engine)
    return SqlStore(empty_engine, ScoringConfig(window_versions=2))


def plays_for(env_id: str, spec: list[tuple[int, bool, float, int]], tag: str = "") -> list[Play]:
    return [
        Play(env_id, seed, hinted, ret, 3, version, f"{env_id}-{tag}{i}")
        for i, (seed, hinted, ret, version) in enumerate(spec)
    ]


def test_migrations_run_from_empty_and_match_the_models(empty_engine: Engine) -> None:
    migrate(empty_engine)
    migrate(empty_engine)  # idempotent
    tables = set(inspect(empty_engine).get_table_names())
    assert {"environments", "env_stats", "plays", "alembic_version"} <= tables
    with empty_engine.connect() as conn:
        assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar() == "0001"
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    assert diff == [], f"models and migrations disagree: {diff}"


def test_put_get_roundtrip(store: SqlStore) -> None:
    res = store.put_environment(
        new_env(
            "Maze",
            validation_report={"valid": True, "checks": [{"name": "syntax", "passed": True}]},
            weight_version=3,
            designer_sample_id="ds1",
            parent_ids=("p1",),
            corpus_ref="doc-9",
        )
    )
    assert not res.duplicate
    env = store.get_environment(res.env_id)
    assert (env.skill, env.hint, env.weight_version, env.designer_sample_id) == (
        "Logical Deduction",
        "hint for Maze",
        3,
        "ds1",
    )
    assert env.validation_report["checks"][0]["name"] == "syntax"
    assert env.parent_ids == ("p1",) and env.corpus_ref == "doc-9" and env.status is EnvStatus.VALID
    assert env.stats.plays == 0 and env.stats.win_rate is None
    assert env.created_at.tzinfo is not None
    with pytest.raises(EnvironmentNotFound, match="nope"):
        store.get_environment("nope")


def test_identical_code_after_normalisation_is_stored_once_and_reported(store: SqlStore) -> None:
    first = store.put_environment(new_env("Maze"))
    reformatted = '"""A docstring."""\n# a comment\n' + env_code("Maze").replace("return 1", "return   1  # why")
    dup = store.put_environment(NewEnvironment(setting="game", skill="Optimization", code=reformatted, hint="other"))
    assert dup.duplicate and dup.duplicate_of == first.env_id and dup.env_id == first.env_id
    assert store.stats().total == 1
    other = store.put_environment(NewEnvironment(setting="game", skill="x", code=env_code("Maze", "return 2")))
    assert not other.duplicate and other.env_id != first.env_id


def test_concurrent_puts_of_the_same_code_store_one(store: SqlStore) -> None:
    results = []
    barrier = threading.Barrier(4)

    def put() -> None:
        barrier.wait()
        results.append(store.put_environment(new_env("Race")))

    threads = [threading.Thread(target=put) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({r.env_id for r in results}) == 1
    assert sum(not r.duplicate for r in results) == 1
    assert store.stats().total == 1


def test_bad_environments_are_refused(store: SqlStore) -> None:
    with pytest.raises(InvalidArgument, match="setting 'board'"):
        store.put_environment(new_env("A", setting="board"))


def test_pagination_is_stable_under_inserts(store: SqlStore) -> None:
    ids = [store.put_environment(new_env(f"E{i}")).env_id for i in range(25)]
    seen: list[str] = []
    page = store.list_environments(EnvFilter(), limit=10)
    seen += [e.id for e in page.items]
    for i in range(5):  # new environments arrive between page requests
        store.put_environment(new_env(f"Late{i}"))
    while page.next_cursor:
        page = store.list_environments(EnvFilter(), limit=10, cursor=page.next_cursor)
        seen += [e.id for e in page.items]
    assert seen == list(reversed(ids)), "pages skipped or repeated environments"
    with pytest.raises(InvalidArgument, match="cursor"):
        store.list_environments(EnvFilter(), cursor="garbage!")
    with pytest.raises(InvalidArgument, match="limit 0"):
        store.list_environments(EnvFilter(), limit=0)


def test_filters(store: SqlStore) -> None:
    a = store.put_environment(new_env("Alpha", skill="Optimization")).env_id
    b = store.put_environment(new_env("Beta", setting="tool", skill="Data Retrieval")).env_id
    c = store.put_environment(new_env("Gamma_100%", status=EnvStatus.INVALID)).env_id
    store.record_plays(plays_for(a, [(1, False, 0.0, 0), (1, True, 1.0, 0)]))  # win 0.0, regret 1.0
    store.record_plays(plays_for(b, [(1, False, 1.0, 0), (1, True, 1.0, 0)]))  # win 1.0, regret 0.0

    def ids(**kw: object) -> set[str]:
        return {e.id for e in store.list_environments(EnvFilter(**kw)).items}  # type: ignore[arg-type]

    assert ids() == {a, b, c}
    assert ids(setting="tool") == {b}
    assert ids(skill="Optimization") == {a}
    assert ids(status=EnvStatus.INVALID) == {c}
    assert ids(min_regret=0.5) == {a}
    assert ids(max_win_rate=0.5) == {a}
    assert ids(q="BETAENV") == {b}  # case-insensitive, code
    assert ids(q="hint for alpha") == {a}  # hint
    assert ids(q="100%") == {c}  # wildcards are literal
    assert ids(q="1_0") == set()


def test_plays_are_idempotent_and_scored(store: SqlStore) -> None:
    env_id = store.put_environment(new_env("Scored", weight_version=5)).env_id
    spec = [
        (1, False, 0.0, 5),
        (1, True, 1.0, 5),
        (2, False, 1.0, 5),
        (2, True, 1.0, 5),
        (9, True, 1.0, 5),  # hinted only: no unhinted partner, ignored by regret
        (3, False, 1.0, 6),  # later version in the window: win rate only
        (4, False, 1.0, 7),  # outside the window of 2 versions
    ]
    assert store.record_plays(plays_for(env_id, spec)).recorded == 7
    again = store.record_plays(plays_for(env_id, spec))  # a re-delivered batch
    assert (again.recorded, again.duplicates) == (0, 7)
    st = store.get_environment(env_id).stats
    assert (st.plays, st.window_plays) == (7, 3)
    assert st.win_rate == pytest.approx(2 / 3)
    assert st.regret == pytest.approx(0.5)
    assert st.learnable
    plays, nxt = store.plays(env_id, limit=4)
    assert len(plays) == 4 and nxt is not None
    rest, end = store.plays(env_id, limit=4, cursor=nxt)
    assert len(rest) == 3 and end is None
    assert {p.trajectory_id for p in plays + rest} == {p.trajectory_id for p in plays_for(env_id, spec)}


def test_a_batch_naming_an_unknown_environment_stores_nothing(store: SqlStore) -> None:
    env_id = store.put_environment(new_env("Known")).env_id
    batch = plays_for(env_id, [(1, False, 1.0, 0)]) + plays_for("ghost", [(1, False, 1.0, 0)])
    with pytest.raises(EnvironmentNotFound, match="ghost"):
        store.record_plays(batch)
    assert store.get_environment(env_id).stats.plays == 0
    with pytest.raises(InvalidArgument, match="trajectory_id"):
        store.record_plays([Play(env_id, 1, False, 1.0, 1, 0, "")])
    with pytest.raises(InvalidArgument, match="finite"):
        store.record_plays([Play(env_id, 1, False, float("nan"), 1, 0, "nan-play")])
    with pytest.raises(InvalidArgument, match="finite"):
        store.update_stats(env_id, StatsUpdate({"blend": float("inf")}))


def test_update_stats_merges_components_and_moves_status(store: SqlStore) -> None:
    env_id = store.put_environment(new_env("Learn")).env_id
    store.record_plays(plays_for(env_id, [(1, False, 1.0, 0)]))
    assert not store.get_environment(env_id).stats.learnable  # win rate 1.0
    env = store.update_stats(env_id, StatsUpdate(reward_components={"regret_norm": 0.5}, learnable=True))
    assert env.stats.learnable and env.stats.reward_components["regret_norm"] == 0.5
    env = store.update_stats(env_id, StatsUpdate(reward_components={"blend": 0.7}, status=EnvStatus.RETIRED))
    assert env.status is EnvStatus.RETIRED
    assert env.stats.reward_components["regret_norm"] == 0.5 and env.stats.reward_components["blend"] == 0.7
    store.record_plays(plays_for(env_id, [(2, False, 1.0, 0)], tag="b"))  # rescoring keeps the override
    assert store.get_environment(env_id).stats.learnable
    with pytest.raises(EnvironmentNotFound):
        store.update_stats("ghost", StatsUpdate())


def test_aggregate_stats(store: SqlStore) -> None:
    a = store.put_environment(new_env("A")).env_id
    b = store.put_environment(new_env("B", skill="Optimization")).env_id
    store.put_environment(new_env("C", status=EnvStatus.INVALID))
    store.record_plays(plays_for(a, [(1, False, 0.0, 0), (2, False, 1.0, 0), (1, True, 1.0, 0)]))
    store.record_plays(plays_for(b, [(1, False, 1.0, 0), (1, True, 1.0, 0)]))
    st = store.stats()
    assert st.total == 3 and st.by_status == {"valid": 2, "invalid": 1}
    assert st.by_skill == {"Logical Deduction": 2, "Optimization": 1}
    assert st.scored == 2 and st.learnable_fraction == 0.5
    assert st.mean_regret == pytest.approx((1.0 + 0.0) / 2)
    assert st.validity_rate == pytest.approx(2 / 3) and st.plays == 5
