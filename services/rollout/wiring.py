"""Builds the rollout's object graph from settings: the only place adapters meet the core.

``rollout_worker`` yields a ready ``RolloutWorker`` and closes everything it opened on exit. In
embedded mode (``spade run``) the caller passes the objects the process shares — the in-process
queue, the memory service, the sandbox pool, the inference client — and only the missing ones are
built here.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path

from services.rollout.core.episode import EpisodeRunner
from services.rollout.core.ports import SessionOpener
from services.rollout.memory import MemoryApi, MemoryServicePlays
from services.rollout.policy import FormatterTemplate, InferenceGenerator
from services.rollout.sandbox import PoolSessions
from services.rollout.settings import RolloutSettings
from services.rollout.state_store import RolloutStateStore
from services.rollout.worker import RolloutWorker, WorkerConfig
from spade.endpoints import MemoryEndpoint, SandboxEndpoint
from spade.inference.client import InferenceClient
from spade.inference.discovery import following
from spade.queues.base import WorkQueue
from spade.queues.config import make_queue
from spade.sandbox.client import SandboxClient

log = logging.getLogger("spade.rollout")


def worker_config(settings: RolloutSettings) -> WorkerConfig:
    """The worker's scheduling options from settings."""
    return WorkerConfig(
        consumer=settings.consumer_name,
        group=settings.consumer_group,
        group_size=settings.group_size,
        window=settings.window_versions,
        max_concurrent_plays=settings.max_concurrent_plays,
        play_retry=settings.retry,
        max_deliveries=settings.max_deliveries,
        lease_s=settings.lease_s,
        poll_s=settings.poll_s,
        block_ms=settings.block_ms,
        publish_hinted=settings.publish_hinted,
        drop_mixed_versions=settings.drop_mixed_version_plays,
    )


def _tokenizer_path(settings: RolloutSettings) -> Path:
    if settings.tokenizer_path is not None:
        return settings.tokenizer_path
    from spade.inference.models import ensure_default_model

    return ensure_default_model()


@contextlib.asynccontextmanager
async def rollout_worker(
    settings: RolloutSettings,
    *,
    queue: WorkQueue | None = None,
    memory: MemoryApi | None = None,
    sessions: SessionOpener | None = None,
    inference: InferenceClient | None = None,
) -> AsyncIterator[RolloutWorker]:
    """Build a rollout worker from ``settings`` (injected objects are used as they are, never closed)."""
    async with contextlib.AsyncExitStack() as stack:
        if queue is None:
            queue = make_queue(settings.queue)
            stack.push_async_callback(queue.close)
        if memory is None:
            memory = await _memory(settings, stack)
        if sessions is None:
            sessions = await _sessions(settings, stack)
        if inference is None:
            inference = InferenceClient(
                settings.inference_urls, tokenizer_path=_tokenizer_path(settings), retry=settings.retry
            )
            stack.push_async_callback(inference.aclose)
            await inference.wait_ready()
            await stack.enter_async_context(following(settings.inference_discovery, inference.set_urls))
        template = FormatterTemplate(inference.formatter)
        runner = EpisodeRunner(sessions, InferenceGenerator(inference), template, settings.play_limits())
        store = RolloutStateStore.from_url(settings.state_url)
        stack.callback(store.dispose)
        adapter = MemoryServicePlays(memory)
        yield RolloutWorker(queue, store, adapter, adapter, runner, worker_config(settings))


async def _memory(settings: RolloutSettings, stack: contextlib.AsyncExitStack) -> MemoryApi:
    cfg = settings.memory
    if isinstance(cfg, MemoryEndpoint):
        from spade.memory.client import MemoryClient

        client = MemoryClient(cfg.target, timeout_s=cfg.timeout_s)
        stack.push_async_callback(client.close)
        return client
    from services.memory.service import MemoryService
    from services.memory.store.sql import SqlStore, make_engine, migrate

    engine = make_engine(cfg.url)
    stack.callback(engine.dispose)
    migrate(engine)
    return MemoryService(SqlStore(engine))


async def _sessions(settings: RolloutSettings, stack: contextlib.AsyncExitStack) -> SessionOpener:
    cfg = settings.sandbox
    if isinstance(cfg, SandboxEndpoint):
        client = SandboxClient(
            cfg.target, cfg.key(), timeout_s=cfg.timeout_s, open_timeout_s=cfg.open_timeout_s, retry=cfg.retry
        )
        stack.push_async_callback(client.close)
        return client
    from services.sandbox.isolation import SandboxPool
    from services.sandbox.isolation.settings import IsolationSettings

    pool = SandboxPool(IsolationSettings.model_validate(cfg.isolation))
    await pool.start()
    stack.push_async_callback(pool.stop)
    return PoolSessions(pool, cfg.checks)
