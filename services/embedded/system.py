"""The embedded system's parts: every service started in this process, and the pools it plays.

The same service code as distributed mode runs here, wired to in-process parts: the isolated
sandbox pool, a SQLite memory, the in-process queue and the embedded SGLang-compatible server (over
HTTP on loopback, so the same inference client is used).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import resource
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.embedded.settings import RunSettings
from services.memory.service import MemoryService
from spade.auth import generate_key
from spade.envs.types import Setting
from spade.serving.logs import get_logger

if TYPE_CHECKING:  # the parts' modules load torch and the model server: imported when the run starts
    from services.inference.settings import InferenceSettings, WeightsMode
    from services.inference.wiring import ServerHandle
    from services.sandbox.isolation import SandboxPool
    from spade.envs import CheckConfig, ValidationReport
    from spade.inference.client import InferenceClient
    from spade.queues.inprocess import InProcessQueue

log = get_logger(__name__)


def release_freed_memory() -> None:
    """Hand the C heap's freed pages back to the system (glibc's ``malloc_trim``); elsewhere, nothing.

    Torch on CPU frees a training step's activations to the C heap, which keeps them: a default run's
    memory grew by gigabytes a step (12.4 GB after step 1, 16.8 GB after step 2, on a 24 GB machine)
    though what it holds alive stays the same. The embedded run calls this after the warm start and after every
    learner step (:func:`release_after_step`); under ``spade run``, which keeps what it frees for reuse
    (:func:`keep_freed_memory`), after a learner step only once the machine gets crowded (:func:`release_if_crowded`).
    """
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: its allocator returns memory its own way
        return


KEEP_MEMORY_SWITCH = "SPADE_KEEP_FREED_MEMORY"
"""``0`` keeps glibc's defaults in ``spade run`` (a machine short of memory; the test suite, whose workers
run many things in one process)."""

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep what torch frees, to reuse it; returns whether it could (glibc only).

    By default glibc serves a block of over 32 MB (a chunk of the learner's logits, a layer's activations)
    with a fresh ``mmap`` and unmaps it when freed, each thread from an arena of its own, and trims freed
    memory at the top of the heap: torch's next block of that size is fresh pages again, each zeroed by a
    page fault. A learner step on 5,400 tokens faulted 1.3-2 million pages (5-8 GB) and took 15-17 s; with
    the blocks kept in one heap and reused, 32 faults and 9-10 s (the AMD EPYC VM, 2 threads). So: one arena
    for every thread (their allocations are coarse: a tensor each), blocks up to 1 GiB from the heap, and
    no trimming; the memory stays with the process at its high-water mark.

    Process-wide and for good: ``spade run`` calls it first thing, before any thread has an arena of its own
    (a thread keeps the arena it has; in another arena a block over its 64 MiB heap is mapped afresh still).
    The library's :func:`services.embedded.runner.run` leaves the allocator as it finds it.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        settings = ((_M_ARENA_MAX, 1), (_M_MMAP_THRESHOLD, 1 << 30), (_M_TRIM_THRESHOLD, 2**31 - 1))
        accepted = [libc.mallopt(option, value) == 1 for option, value in settings]  # each one, whatever the others
    except (OSError, AttributeError):  # not glibc: its allocator keeps memory its own way
        return False
    global _kept
    _kept = all(accepted)  # partly set (a glibc refusing one): not kept, so every step still trims
    return _kept


_kept = False
"""Whether :func:`keep_freed_memory` set this process's allocator to keep what it frees."""


CROWDED_SHARE = 0.7
"""The share of the machine's memory (or of the cgroup's limit, in a container) past which the run hands its freed
memory back after a learner step."""


def release_if_crowded(share: float = CROWDED_SHARE) -> bool:
    """:func:`release_freed_memory` once this process holds more than ``share`` of the machine's memory (what
    :func:`keep_freed_memory` keeps is then given back, at the cost of the next step's page faults); returns
    whether it did."""
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        resident = int(Path("/proc/self/statm").read_text().split()[1]) * page
        total = os.sysconf("SC_PHYS_PAGES") * page
    except (OSError, ValueError, IndexError):
        return False
    limit = _cgroup_limit()
    if resident <= share * min(total, limit if limit is not None else total):
        return False
    release_freed_memory()
    return True


def release_after_step() -> bool:
    """After a learner step: where :func:`keep_freed_memory` keeps freed memory for the next step, hand it back
    only once the machine gets crowded (:func:`release_if_crowded`); with glibc's defaults (the library's
    :func:`services.embedded.runner.run`, as tests and notebooks call it), every step, or the heap grows by
    gigabytes a step (a test worker runs it beside other tests on a 24 GB machine). Returns whether it handed
    memory back."""
    if _kept:
        return release_if_crowded()
    release_freed_memory()
    return True


def _cgroup_limit() -> int | None:
    """The memory limit of this process's cgroup (v2 ``memory.max``, v1 ``memory.limit_in_bytes``), if it has one:
    in a container the machine's memory is not what the process may use."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        with contextlib.suppress(OSError, ValueError):
            text = Path(path).read_text().strip()
            if text != "max" and int(text) < 2**60:  # v1 says "no limit" with a huge number
                return int(text)
    return None


def process_memory() -> dict[str, float]:
    """This process's memory now and at its peak, in GB (``process/rss_gb``, ``process/peak_rss_gb``)."""
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KB on Linux
    figures = {"process/peak_rss_gb": round(peak_kb / 2**20, 2)}
    with contextlib.suppress(OSError, ValueError, IndexError):
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        figures["process/rss_gb"] = round(pages * os.sysconf("SC_PAGE_SIZE") / 2**30, 2)
    return figures


class RunSetupError(RuntimeError):
    """The run cannot start as configured (the message is one line for a person, naming the fix)."""


RUN_LEARNER = "run-learner"
"""The tenant of the admin key an embedded run makes for its learner (in the inference server's logs)."""


@dataclass
class EmbeddedParts:
    """What every role of the embedded system shares (built by ``embedded_system``).

    Attributes:
        model: The policy's checkpoint directory (weights and tokenizer).
        server: The embedded inference server, running in a thread of this process.
        client: The inference client every role generates through (over loopback HTTP).
        pool: The sandbox's isolated worker pool (validation and play sessions).
        checks: The limits validation and sessions run with.
        memory: The memory's application layer over a SQLite file in the run directory.
        queue: The in-process implementation of the work queues.
        admin_key: This run's own admin key of the inference server (made at start, never written
            anywhere): the learner publishes weights with it; nothing else holds it.
    """

    model: Path
    server: ServerHandle
    client: InferenceClient
    pool: SandboxPool
    checks: CheckConfig
    memory: MemoryService
    queue: InProcessQueue
    admin_key: str


def served_weights(settings: RunSettings) -> WeightsMode:
    """The weights the run's inference server decodes from: the run's ``inference.weights``, else bf16
    where a decode step reads them faster than fp32, and fp32 elsewhere.

    bf16 serves on a CPU that multiplies bf16 natively (decode steps about 0.6x fp32's; the learner
    multiplies in bf16 too, ``roles.py``'s ``cpu_bf16``, so fp32 serving kept no logprob exactness) and
    on one where the engine's own decode kernel takes every bf16 decode step
    (:func:`services.inference.rows.serves_every_bf16_decode`: AVX2 without AVX-512, fp32 activations times
    bf16 weights). Its rounding of the weights moves the
    rollout's logprobs from an fp32 learner's, which truncated importance sampling corrects
    (docs/inference.md).
    ``inference: {weights: float32}`` (``SPADE_RUN_INFERENCE__WEIGHTS=float32``) serves fp32: logprobs
    within 1e-4 of an fp32 learner's.
    """
    from services.inference import rows
    from spade.cpu_linear import native_bf16

    told: WeightsMode | None = settings.inference.values().get("weights")
    if told is not None:
        return told
    return "bf16" if native_bf16() or rows.serves_every_bf16_decode() else "float32"


def inference_settings(settings: RunSettings, model: Path, admin_digest: str) -> InferenceSettings:
    """The embedded inference server's settings: on a free loopback port, with the run's admin key,
    decoding from :func:`served_weights`.

    ``admin_digest`` (the SHA-256 of the key the run's learner publishes with) is added to any
    ``admin_keys`` the run's ``inference`` section configures.
    """
    from services.inference.settings import InferenceSettings

    values = settings.inference.over(
        {
            "model_path": model,
            "http": {"port": 0},
            "torch_threads": settings.torch_threads,
            "weights": served_weights(settings),
        }
    )
    values["admin_keys"] = [*(values.get("admin_keys") or []), {"tenant": RUN_LEARNER, "key_sha256": admin_digest}]
    return InferenceSettings(**values)


@contextlib.asynccontextmanager
async def embedded_system(settings: RunSettings) -> AsyncIterator[EmbeddedParts]:
    """Start every part of the system in this process; stop all of it on exit."""
    from services.inference.wiring import serve_in_thread
    from services.memory.settings import MemorySettings
    from services.memory.wiring import build_service
    from services.sandbox.isolation import SandboxPool
    from spade.inference.client import InferenceClient
    from spade.inference.models import resolve_model_path
    from spade.queues.inprocess import InProcessQueue

    run_dir = settings.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    model = resolve_model_path(settings.model_path)
    async with contextlib.AsyncExitStack() as stack:
        # The server's admin routes (weight updates) are off without an admin key: this run's learner
        # gets one of its own (EmbeddedParts.admin_key), made here and never written anywhere.
        admin_key, admin_digest = generate_key()
        server = serve_in_thread(inference_settings(settings, model, admin_digest))
        stack.callback(server.stop)
        client = InferenceClient([server.url], tokenizer_path=model, timeout_s=1800.0)
        stack.push_async_callback(client.aclose)
        await client.wait_ready()

        pool = SandboxPool(settings.isolation)
        await pool.start()
        stack.push_async_callback(pool.stop)

        memory_settings = MemorySettings(
            dev_mode=True,
            database_url=f"sqlite:///{(run_dir / 'memory.db').resolve()}",
            window_versions_game=settings.window_versions if settings.setting == Setting.GAME else None,
            window_versions_tool=settings.window_versions if settings.setting == Setting.TOOL else None,
            window=settings.memory_window,
            content_env_ids=True,  # the memory is this run's own: a rerun plays the same seeds
        )
        memory = build_service(memory_settings)
        stack.callback(memory.store.engine.dispose)

        queue = InProcessQueue()
        stack.push_async_callback(queue.close)
        yield EmbeddedParts(
            model=model,
            server=server,
            client=client,
            pool=pool,
            checks=settings.checks,
            memory=memory,
            queue=queue,
            admin_key=admin_key,
        )


async def seed_pool(settings: RunSettings, parts: EmbeddedParts, spec_id: str) -> list[str]:
    """Store and announce the seed pool for the whole run, each env validated in the sandbox first.

    The seed pool is the training environment families (``spade.envs.families``) at
    ``seed_pool_per_family`` difficulties each: envs whose graded returns span a small agent's
    ability, so the agent has signal to learn from while the designer supplies too little. A setting
    without families falls back to the contract's example envs. Held-out families are never stored.

    Raises:
        RunSetupError: No env of the seed pool passed validation.
    """
    from services.embedded.pools import StaticEnv, StaticPoolError, store_static_pool
    from services.memory.seed_pool import seed_pool as load_examples
    from spade.envs.families import seed_pool_envs

    async def validate(code: str, setting: str) -> ValidationReport:
        return await parts.pool.validate(code, setting, parts.checks)

    # The seed pool stays active for the whole run (designed envs use k): a pool env is played at
    # most once a step, so steps + 1 slots never run out.
    window = settings.steps + 1
    families = seed_pool_envs(settings.setting, per_family=settings.seed_pool_per_family)
    if not families:
        return await load_examples(
            settings.setting, parts.memory, parts.queue, window_versions=window, validate=validate
        )
    envs = [StaticEnv(e.name, e.setting, e.skill, e.code, e.hint) for e in families]
    try:
        stored = await store_static_pool(
            envs,
            source="spade.envs.families",
            memory=parts.memory,
            queue=parts.queue,
            validate=validate,
            window_versions=window,
            spec_id=spec_id,
            origin="seed pool",
        )
    except StaticPoolError as exc:
        raise RunSetupError(str(exc)) from None
    for name, checks in stored.rejected:
        log.warning("seed pool: %s left out, it failed %s", name, ", ".join(checks))
    return stored.stored


async def static_pool(settings: RunSettings, parts: EmbeddedParts, spec_id: str) -> list[str]:
    """Validate, store and announce ``settings.pool`` for the whole run (``--pool FILE_OR_DIR``).

    Raises:
        RunSetupError: The pool cannot be read or no env of it passed validation.
    """
    from services.embedded.pools import StaticPoolError, read_static_pool, store_static_pool

    assert settings.pool is not None

    async def validate(code: str, setting: str) -> ValidationReport:
        return await parts.pool.validate(code, setting, parts.checks)

    try:
        envs = read_static_pool(settings.pool, settings.setting)
        stored = await store_static_pool(
            envs,
            source=str(settings.pool),
            memory=parts.memory,
            queue=parts.queue,
            validate=validate,
            window_versions=settings.steps + 1,
            spec_id=spec_id,
        )
    except StaticPoolError as exc:
        raise RunSetupError(str(exc)) from None
    for name, checks in stored.rejected:
        log.warning("static pool: %s left out, it failed %s", name, ", ".join(checks))
    return stored.stored


async def export_pool(memory: MemoryService, path: Path) -> list[dict[str, Any]]:
    """Write every stored env (code, hint, report, stats) as JSONL; return the rows for the report."""
    rows: list[dict[str, Any]] = []
    cursor: str | None = None
    with path.open("w") as fh:
        while True:
            page = await memory.list_environments(limit=200, cursor=cursor)
            for env in page.items:
                failed = [c["name"] for c in env.validation_report.get("checks", []) if not c.get("passed")]
                row = {
                    "env_id": env.id,
                    "setting": env.setting,
                    "skill": env.skill,
                    "status": str(env.status),
                    "source": env.corpus_ref.split(":")[0]
                    if env.corpus_ref.startswith(("seed", "static"))
                    else "designer",
                    "env_class": env.env_class,
                    "weight_version": env.weight_version,
                    "win_rate": env.stats.win_rate,
                    "solved_fraction": env.stats.solved_fraction,
                    "regret": env.stats.regret,
                    "regret_note": env.stats.regret_note,
                    "plays": env.stats.plays,
                    "failed_check": failed[0] if failed else "",
                    "corpus_ref": env.corpus_ref,
                }
                fh.write(json.dumps({**row, "code": env.code, "hint": env.hint}) + "\n")
                rows.append(row)
            cursor = page.next_cursor
            if not cursor:
                return rows


def last_checkpoint(checkpoints: Path, target: Path) -> Path | None:
    """Copy the newest checkpoint to ``target`` (the run's 'last checkpoint'), if there is one."""
    if not checkpoints.exists():
        return None
    found = sorted(p for p in checkpoints.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not found:
        return None
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(found[-1], target)
    return target
