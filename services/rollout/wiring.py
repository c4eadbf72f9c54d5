"""Builds the rollout's object graph from settings: the only place adapters meet the core.

``rollout_worker`` yields a ready ``RolloutWorker`` and closes everything it opened on exit. It
builds only clients of other services (``spade/``); what runs in this process instead (a memory
database, a sandbox pool) is built by a composition root and passed in: ``services.rollout.standalone``
for ``spade serve rollout``, ``services.embedded`` for ``spade run``, which also passes the run spec,
its in-process queue and its inference client. In distributed mode the run spec is read from the memory (waiting,
with a log line, until one is stored; a ``run_spec_file`` is stored when none is).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar, cast

from services.rollout.memory import MemoryApi, MemoryServicePlays
from services.rollout.policy import FormatterTemplate, InferenceGenerator
from services.rollout.settings import RolloutSettings
from services.rollout.state_store import RolloutStateStore
from services.rollout.worker import RolloutWorker, WorkerConfig
from spade import dependencies
from spade.agent.episode import EpisodeRunner
from spade.agent.ports import SessionOpener
from spade.dependencies import DEFAULT_WAIT, Dependency, DependencyUnavailable
from spade.endpoints import MemoryEndpoint, SandboxEndpoint
from spade.inference.client import InferenceClient
from spade.inference.discovery import following
from spade.memory.client import MemoryClient
from spade.memory.runspec import RunSpecStore, fetch_run_spec, load_spec_file
from spade.queues.base import WorkQueue
from spade.queues.factory import make_queue
from spade.runspec import RunSpec
from spade.sandbox.client import SandboxClient
from spade.serving.logs import get_logger
from spade.serving.startup import logged_wait

log = get_logger(__name__)

T = TypeVar("T")

Opener = Callable[[contextlib.AsyncExitStack], Awaitable[T]]
"""Opens an in-process part on the exit stack that closes it (a composition root's, passed in)."""

WAIT_LOG_EVERY_S = 30.0
"""While the rollout waits at start (run spec, inference), a line says what for and how long so far."""


def worker_config(settings: RolloutSettings, spec: RunSpec) -> WorkerConfig:
    """The worker's scheduling options from settings, under the run spec."""
    return WorkerConfig(
        consumer=settings.consumer_name,
        spec=spec,
        group=settings.consumer_group,
        max_concurrent_plays=settings.max_concurrent_plays,
        max_concurrent_envs=settings.max_concurrent_envs,
        max_concurrent_audit_plays=settings.max_concurrent_audit_plays,
        audit_paced=settings.audit_paced,
        play_retry=settings.retry,
        max_attempts=settings.max_attempts,
        lease_s=settings.lease_s,
        poll_s=settings.poll_s,
        block_ms=settings.block_ms,
        shutdown_grace_s=settings.shutdown_grace_s,
        publish_hinted=settings.publish_hinted,
        drop_mixed_versions=settings.drop_mixed_version_plays,
        sampling_run=settings.sampling_run,
        zero_variance_extensions=settings.zero_variance_extensions,
    )


async def waiting(what: str, work: Awaitable[T], stop: asyncio.Event | None) -> T:
    """Await ``work`` as every service's start waits (``spade.serving.startup.logged_wait``).

    Raises:
        StoppedWhileWaiting: ``stop`` was set first (``work`` is cancelled).
    """
    return await logged_wait(what, work, stop=stop, every_s=WAIT_LOG_EVERY_S, service="rollout", logger=log)


async def wait_ready(deps: list[Dependency | None], stop: asyncio.Event | None) -> None:
    """Wait until each dependency answers (``spade.dependencies``' checks and policy), giving way to SIGTERM.

    Raises:
        DependencyUnavailable: One did not answer within the policy's tries.
        StoppedWhileWaiting: ``stop`` was set first.
    """
    for dep in deps:
        if dep is None:
            continue
        what = dep.describe()

        async def check(dep: Dependency = dep, what: str = what) -> None:
            retrying = DEFAULT_WAIT.async_retrying(DependencyUnavailable, logger=log, what=f"waiting for {what}")
            async for attempt in retrying:
                with attempt:
                    await asyncio.to_thread(dep.check)  # one check is short (its own timeout)

        await waiting(what, check(), stop)


async def run_spec(settings: RolloutSettings, memory: RunSpecStore, stop: asyncio.Event | None = None) -> RunSpec:
    """The run spec from the memory (storing ``run_spec_file`` when none is stored), checked against the settings.

    Raises:
        ConfigError: The spec file is unreadable or invalid; ``SpecContradiction``: the settings
            contradict the spec (one line per field).
        RunSpecConflict: The spec file differs from the stored spec.
        StoppedWhileWaiting: Stopped before a spec was stored.
    """
    given = load_spec_file(settings.run_spec_file) if settings.run_spec_file is not None else None
    fetch = fetch_run_spec(memory, given=given, service="rollout", log_every_s=3600.0)
    spec = await waiting("a run spec in the memory (`spade runspec set FILE`)", fetch, stop)
    settings.check_spec(spec)
    return spec


def _tokenizer_path(settings: RolloutSettings) -> Path:
    if settings.tokenizer_path is not None:
        return settings.tokenizer_path
    from spade.inference.models import ensure_default_model

    return ensure_default_model()


@contextlib.asynccontextmanager
async def rollout_worker(
    settings: RolloutSettings,
    *,
    spec: RunSpec | None = None,
    stop: asyncio.Event | None = None,
    queue: WorkQueue | None = None,
    memory: MemoryApi | None = None,
    sessions: SessionOpener | None = None,
    inference: InferenceClient | None = None,
    open_memory: Opener[MemoryApi] | None = None,
    open_sessions: Opener[SessionOpener] | None = None,
) -> AsyncIterator[RolloutWorker]:
    """Build a rollout worker from ``settings`` (injected objects are used as they are, never closed).

    Args:
        settings: The rollout's settings.
        spec: The run spec (embedded: built once by the run); None: read from the memory.
        stop: Set by SIGTERM: waiting at start (run spec, inference) gives up with
            ``StoppedWhileWaiting``.
        queue: The work queues (built from ``settings.queue`` when None).
        memory: The memory (when None: ``open_memory``'s, else a client of ``settings.memory``).
        sessions: The sandbox (when None: ``open_sessions``'s, else a client of ``settings.sandbox``).
        inference: The inference client (built from ``settings.inference_urls`` when None).
        open_memory: Opens an in-process memory on the given exit stack, at the point where the
            memory is needed (after the state database and the queue answer, before the run spec);
            a composition root's (``services.rollout.standalone``), as this wiring opens only clients.
        open_sessions: Starts an in-process sandbox likewise, after the run spec is checked.

    Raises:
        SpecContradiction: The settings contradict the run spec (before anything else is started).
    """
    # The services built here from settings (injected ones are the caller's): waited for at start, and
    # probed when a slot fails (a failure while one is down is an outage, not counted against the slot).
    stores = [
        dependencies.postgres(settings.state_url),
        None if queue is not None else dependencies.queue(settings.queue),
        None if memory is not None else dependencies.endpoint(settings.memory),
    ]
    sandbox = None if sessions is not None else dependencies.endpoint(settings.sandbox)
    servers = [] if inference is not None else dependencies.inference(settings.inference_urls)
    async with contextlib.AsyncExitStack() as stack:
        await wait_ready(stores, stop)
        if memory is None:
            opened = open_memory(stack) if open_memory is not None else _client(settings.memory, "memory", stack)
            memory = await opened
        if spec is None:
            if not hasattr(memory, "get_run_spec"):
                raise TypeError("the memory given to the rollout cannot read the run spec: pass spec=")
            spec = await run_spec(settings, cast(RunSpecStore, memory), stop)
        else:
            settings.check_spec(spec)
        await wait_ready([sandbox, *servers], stop)
        if queue is None:
            queue = make_queue(settings.queue)
            stack.push_async_callback(queue.close)
        if sessions is None:
            started = open_sessions(stack) if open_sessions is not None else _client(settings.sandbox, "sandbox", stack)
            sessions = await started
        if inference is None:
            inference = InferenceClient(
                settings.inference_urls,
                tokenizer_path=_tokenizer_path(settings),
                retry=settings.retry,
                api_key=settings.inference.key(),
                tls=settings.inference.tls,
            )
            stack.push_async_callback(inference.aclose)
            await waiting("the inference workers (/health_generate)", inference.wait_ready(), stop)
            await stack.enter_async_context(following(settings.inference_discovery, inference.set_urls))
        template = FormatterTemplate(inference.formatter)
        runner = EpisodeRunner(sessions, InferenceGenerator(inference), template, settings.play_limits(spec))
        store = RolloutStateStore.from_url(settings.state_url)
        stack.callback(store.dispose)
        # Under discovery inference_urls are only the start: the client's own InferenceUnavailable tells.
        probed = [*stores, sandbox, *([] if settings.inference_discovery else servers)]
        probes = [dep for dep in probed if dep is not None]
        yield RolloutWorker(queue, store, MemoryServicePlays(memory), runner, worker_config(settings, spec), probes)


async def _client(cfg: Any, part: str, stack: contextlib.AsyncExitStack) -> Any:
    """A client of the ``memory`` or the ``sandbox`` service, closed with ``stack``.

    Raises:
        TypeError: ``cfg`` asks for the part in this process, which only a composition root opens.
    """
    endpoint, client_type, given = _CLIENTS[part]
    if not isinstance(cfg, endpoint):
        raise TypeError(
            f"{part} kind {cfg.kind!r} runs in this process: a composition root (services.rollout.standalone, "
            f"services.embedded) passes it in ({given}= or open_{given}=)"
        )
    client = client_type.from_endpoint(cfg)
    stack.push_async_callback(client.close)
    return client


_CLIENTS: dict[str, tuple[type, Any, str]] = {
    "memory": (MemoryEndpoint, MemoryClient, "memory"),
    "sandbox": (SandboxEndpoint, SandboxClient, "sessions"),
}
"""Each service part: its endpoint settings, its client, and ``rollout_worker``'s parameter for it."""
