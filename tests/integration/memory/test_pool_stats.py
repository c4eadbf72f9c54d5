"""The pool's process metrics in ``/v1/stats``: the real sandbox probes, the packaged MiniLM embeds,
and every figure equals ``spade.pool_metrics`` / ``spade.signal`` applied to the same envs directly."""

from __future__ import annotations

import asyncio
import textwrap
from collections.abc import AsyncIterator, Sequence
from typing import Any

import numpy as np
import pytest
from sqlalchemy import Engine, func, select

from services.memory.service import MemoryService
from services.memory.store.models import EnvEmbeddingRow
from services.memory.store.sql import SqlStore, migrate
from services.memory.wiring import probe_forever
from services.sandbox.isolation import SandboxPool
from services.sandbox.isolation.settings import IsolationSettings
from spade import pool_metrics as pm
from spade import signal
from spade.envs.examples import EXAMPLES
from spade.envs.types import FinishReason, Setting
from spade.memory.records import EnvProbe, EnvStatus, NewEnvironment, Play
from tests.conftest import needs
from tests.integration.memory.conftest import new_env

LEAKY_ENV = textwrap.dedent(
    """
    import random

    class SecretEnv:
        max_turns = 3

        def reset(self, seed=None):
            self.rng = random.Random(seed)
            self.secret = self.rng.randint(100, 999)
            return f"Guess my number. (Between us: the secret number is {self.secret}.)", {}

        def step(self, action):
            won = action.strip() == "\\\\boxed{%d}" % self.secret
            return ("yes" if won else "no"), (1.0 if won else 0.0), True, False, {}

        def solution(self):
            return ["\\\\boxed{%d}" % self.secret]
    """
)


class CountingEmbedder:
    """The real MiniLM embedder, counting the descriptions it is asked to embed (a spy, not a fake)."""

    def __init__(self) -> None:
        self.inner = pm.MiniLMEmbedder()
        self.embedded = 0

    def encode(self, texts: Sequence[str]) -> Any:
        self.embedded += len(texts)
        return self.inner.encode(texts)


@pytest.fixture
@needs("sandbox")
async def sandbox() -> AsyncIterator[SandboxPool]:
    pool = SandboxPool(IsolationSettings())
    await pool.start()
    try:
        yield pool
    finally:
        await pool.stop()


@pytest.mark.model
@pytest.mark.slow
async def test_process_metrics_equal_the_shared_definitions(empty_engine: Engine, sandbox: SandboxPool) -> None:
    migrate(empty_engine)
    embedder = CountingEmbedder()
    service = MemoryService(SqlStore(empty_engine, embedder=embedder, metrics_window=4))
    pool: list[tuple[str, str, str]] = []  # (env id, setting, code), oldest first
    for i, (name, example) in enumerate(sorted(EXAMPLES.items())):
        setting = example.setting
        env = NewEnvironment(setting, example.skill, example.code, corpus_ref=f"doc-{i % 3}", env_class=name)
        pool.append(((await service.put_environment(env)).env_id, setting, example.code))
    leaky = (await service.put_environment(NewEnvironment(Setting.GAME, "Optimization", LEAKY_ENV))).env_id
    pool.append((leaky, "game", LEAKY_ENV))
    await service.put_environment(new_env("Broken", status=EnvStatus.INVALID))  # not in the pool

    assert await service.probe_pending(sandbox) == len(pool)  # env code ran in the sandbox only
    assert await service.probe_pending(sandbox) == 0

    returns = {pool[0][0]: [0.0, 0.5, 0.5, 1.0], pool[1][0]: [1.0, 1.0], pool[2][0]: [0.0, 0.25, 0.0]}
    turns = {pool[0][0]: [1, 2, 3, 4], pool[1][0]: [2, 2], pool[2][0]: [5, 1, 3]}
    for env_id, rs in returns.items():
        await service.record_plays(
            [
                Play(env_id, s, False, r, turns[env_id][s], 0, f"{env_id}-{s}", FinishReason.TERMINATED)
                for s, r in enumerate(rs)
            ]
        )

    stats = await service.stats()
    p = stats.pool

    # The same envs through spade.pool_metrics / spade.signal directly (a fresh probe per env).
    probes = [await pm.probe_env(sandbox, code, setting) for _, setting, code in pool]
    descriptions = [
        pm.env_description(code, pr.first_observation) for (_, _, code), pr in zip(pool, probes, strict=True)
    ]
    game_verdicts = [
        pm.leaks_answer(pr.first_observation, pr.solution)
        for (_, setting, _), pr in zip(pool, probes, strict=True)
        if setting == "game"
    ]
    rates = [signal.win_rate(rs) for rs in returns.values()]

    assert (p.envs, p.probed, p.hash_distinct, p.distinct_documents) == (len(pool), len(pool), len(pool), 3)
    assert p.program_lines_mean == pytest.approx(np.mean([pm.program_length(c).lines for _, _, c in pool]))
    assert p.program_chars_mean == pytest.approx(np.mean([pm.program_length(c).chars for _, _, c in pool]))
    assert p.reward_levels_mean == pytest.approx(np.mean([pm.reward_levels(rs) for rs in returns.values()]))
    assert p.interaction_turns_mean == pytest.approx(np.mean([pm.interaction_turns(t) for t in turns.values()]))
    assert p.hidden_state_size_mean == pytest.approx(np.mean([pr.hidden_state_size for pr in probes]))
    assert p.hidden_state_bytes_mean == pytest.approx(np.mean([pr.hidden_state_bytes for pr in probes]))
    assert p.leakage_share == pm.leakage_share(game_verdicts) and 0 < (p.leakage_share or 0) < 1
    assert p.learnable_fraction == signal.learnable_fraction(rates)
    assert p.learnable_fraction_window == signal.learnable_fraction(rates)  # 3 scored envs, window of 4
    assert p.vendi_n == 4 and p.vendi_note == ""
    assert p.vendi_per_n == pytest.approx(pm.vendi_per_n(descriptions, embedder.inner, window=4), rel=1e-5)
    assert stats.metrics()["pool/vendi_per_n"] == p.vendi_per_n

    # Cached until the memory changes; embeddings are computed once per env and kept in the database.
    assert embedder.embedded == 4
    assert await service.stats() is stats
    with empty_engine.connect() as c:
        assert c.scalar(select(func.count()).select_from(EnvEmbeddingRow)) == 4
    await service.record_plays([Play(pool[0][0], 9, False, 1.0, 1, 0, "late", FinishReason.TERMINATED)])
    after_play = await service.stats()
    assert after_play is not stats and after_play.plays == stats.plays + 1 and embedder.embedded == 4
    await service.put_environment(new_env("Newcomer"))
    after_env = await service.stats()
    assert after_env.pool.envs == len(pool) + 1 and embedder.embedded == 5  # only the new env was embedded
    await service.record_probe(EnvProbe(leaky, first_observation="A new first observation"))
    await service.stats()
    assert embedder.embedded == 6  # its description changed, so it is embedded again


async def test_without_the_vendi_metric_the_stats_say_why(empty_engine: Engine) -> None:
    migrate(empty_engine)
    service = MemoryService(SqlStore(empty_engine))
    assert (await service.stats()).pool.vendi_note.startswith("off")
    await service.put_environment(new_env("Only"))
    stats = await service.stats()
    assert stats.pool.vendi_per_n is None and "vendi: false" in stats.pool.vendi_note
    assert stats.pool.probed == 0 and stats.pool.leakage_share is None and stats.pool.hidden_state_size_mean is None
    await service.put_environment(new_env("Second"))
    assert await service.stats(max_age_s=3600) is stats  # the REST API's refresh interval: not looked at yet
    assert (await service.stats()).pool.envs == 2  # current figures on request


async def test_the_served_memory_probes_new_pool_envs_in_the_background(
    empty_engine: Engine, sandbox: SandboxPool
) -> None:
    migrate(empty_engine)
    service = MemoryService(SqlStore(empty_engine))
    number_hunt = EXAMPLES["number_hunt"]
    await service.put_environment(NewEnvironment(Setting.GAME, number_hunt.skill, number_hunt.code))
    stop = asyncio.Event()
    prober = asyncio.create_task(probe_forever(service, sandbox, every_s=0.2, stop=stop))
    for _ in range(200):
        if (await service.stats()).pool.probed:
            break
        await asyncio.sleep(0.1)
    stop.set()
    await asyncio.wait_for(prober, 30)
    pool = (await service.stats()).pool
    assert pool.probed == 1 and (pool.hidden_state_size_mean or 0) >= 1 and pool.leakage_share == 0.0


class UnwritableCacheEmbedder:
    """An embedder whose model cannot load (a read-only root filesystem, say): the failure path."""

    def encode(self, texts: Sequence[str]) -> Any:
        raise OSError(30, "Read-only file system", "/home/spade/.cache")


async def test_a_failing_embedder_leaves_the_other_figures_served(empty_engine: Engine) -> None:
    migrate(empty_engine)
    service = MemoryService(SqlStore(empty_engine, embedder=UnwritableCacheEmbedder()))
    await service.put_environment(new_env("Served"))
    stats = await service.stats()
    assert stats.pool.vendi_per_n is None and stats.pool.vendi_note.startswith("unavailable: OSError")
    assert stats.pool.envs == 1 and stats.total == 1
