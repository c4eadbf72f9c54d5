"""Builds the learner's object graph from its settings and the run spec (the only place adapters meet the core)."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from services.learner.checkpoint import CheckpointManager
from services.learner.collective import Follower
from services.learner.core.losses import build_loss
from services.learner.core.window import ScoredAttempt
from services.learner.distributed import World, init_world
from services.learner.learner import Learner, RewardCallback
from services.learner.publisher import WeightPublisher
from services.learner.settings import LearnerSettings
from services.learner.trainer import OptimConfig, Trainer, shard_model
from services.learner.versions import VersionWriter
from spade import cpu_linear, openmp
from spade.memory.records import StatsUpdate
from spade.memory.runspec import RunSpecStore, fetch_run_spec, load_spec_file
from spade.queues.base import WorkQueue
from spade.queues.factory import make_queue
from spade.runspec import RunSpec
from spade.serving.logs import get_logger
from spade.serving.startup import logged_wait

logger = get_logger(__name__)


class StatsWriter(Protocol):
    """The memory call the learner reports designer rewards through (``MemoryClient`` or ``MemoryService``)."""

    async def update_stats(self, env_id: str, update: StatsUpdate) -> Any: ...


def memory_reward_sink(memory: StatsWriter) -> Callable[[ScoredAttempt], Awaitable[None]]:
    """A ``on_designer_reward`` callback storing each scored env's reward components in the memory.

    The components (``regret``, ``regret_norm``, ``window_win_rate``, ``plateau``, ``trivial_win_rate``,
    ``blend``) are
    ``spade.signal``'s, as the learner rewarded the designer; invalid attempts (no env) and unscored
    ones are skipped. A memory that cannot be reached costs a log line, never the learner's step: the
    same figures are in the step's log line.
    """

    async def sink(scored: ScoredAttempt) -> None:
        c = scored.components
        if c is None or not scored.attempt.env_id:
            return
        values = {
            "regret": c.regret,
            "regret_norm": c.regret_norm,
            "window_win_rate": c.window_win_rate,
            "plateau": c.plateau,
            "trivial_win_rate": c.trivial_win_rate,
            "blend": c.blend,
        }
        update = StatsUpdate(reward_components={k: float(v) for k, v in values.items() if v is not None})
        try:
            await memory.update_stats(scored.attempt.env_id, update)
        except Exception as exc:  # a boundary: the memory's outage must not stop training
            logger.warning(
                "could not store designer sample %s's reward in the memory: %s: %s",
                scored.attempt.sample_id,
                type(exc).__name__,
                exc,
            )

    return sink


async def run_spec_from_memory(
    settings: LearnerSettings, memory: RunSpecStore, stop: asyncio.Event | None = None
) -> RunSpec:
    """The run spec from the memory (storing ``run_spec_file`` when none is stored), checked against the settings.

    Waits until one is stored, logging what it waits for and for how long every ``spec_wait_log_s``.

    Raises:
        ConfigError: The spec file is unreadable or invalid.
        SpecContradiction: The settings contradict the spec (one line per field).
        RunSpecConflict: The spec file differs from the stored spec.
        StoppedWhileWaiting: ``stop`` was set before a spec was stored.
    """
    given = load_spec_file(settings.run_spec_file) if settings.run_spec_file is not None else None
    fetch = fetch_run_spec(memory, given=given, service="learner", poll_s=1.0, log_every_s=float("inf"))
    spec = await logged_wait(
        f"a run spec in the memory at {settings.memory.target} (store one with `spade runspec set FILE`)",
        fetch,
        stop=stop,
        every_s=settings.spec_wait_log_s,
        service="learner",
        logger=logger,
    )
    settings.check_spec(spec)
    return spec


def resolve_base_model(settings: LearnerSettings) -> Path:
    """The base checkpoint directory (the embedded SmolLM2 in dev mode when none is configured)."""
    from spade.inference.models import resolve_model_path

    return resolve_model_path(settings.model_path)


def pick_device(settings: LearnerSettings, world: World) -> torch.device:
    """The training device: ``cuda:<local rank>`` when asked for or available, else the CPU."""
    if settings.device == "cpu" or (settings.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("device=cuda but torch sees no CUDA device; use device=auto or cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", world.rank)))


def load_policy(path: Path, device: torch.device) -> nn.Module:
    """Load a causal LM for training (float32 master weights; bf16 comes from autocast, `Trainer._autocast`).

    On the CPU its linear layers multiply through oneDNN (:mod:`spade.cpu_linear`).
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, local_files_only=True)
    model.config.use_cache = False
    module: nn.Module = model
    if device.type == "cpu":
        cpu_linear.use_onednn_linears(module)  # the same fp32 products, 1.5-2x as fast here
    return module.to(device)


def pad_token_id(path: Path) -> int:
    """The pad id from the checkpoint's config (0 when it has none; padded positions are masked)."""
    config = json.loads((path / "config.json").read_text())
    for key in ("pad_token_id", "eos_token_id"):
        value = config.get(key)
        if isinstance(value, int):
            return value
        if isinstance(value, list) and value:
            return int(value[0])
    return 0


def build_trainer(
    settings: LearnerSettings,
    spec: RunSpec,
    base: Path,
    world: World,
    model_factory: Callable[[Path, torch.device], nn.Module] = load_policy,
) -> Trainer:
    """The model (sharded under torchrun), its frozen reference when the KL is on, and the trainer."""
    torch.manual_seed(settings.seed)
    device = pick_device(settings, world)
    model = model_factory(base, device)
    ref = None
    if settings.loss.kl_coef > 0:
        ref = model_factory(base, device)
    if world.distributed:
        shard_model(model)
        if ref is not None:
            shard_model(ref)
    optim = OptimConfig(
        lr=settings.lr,
        weight_decay=settings.weight_decay,
        betas=(settings.beta1, settings.beta2),
        grad_clip=settings.grad_clip,
        micro_batch_tokens=settings.micro_batch_tokens,
        temperature=spec.temperature,  # the rollout's and designer's: logprobs must match theirs
        bf16=settings.bf16,
        cpu_bf16=settings.cpu_bf16,
        share_prefixes=settings.share_prefixes,
    )
    trainer = Trainer(model, build_loss(settings.loss), optim, ref_model=ref, world=world, pad_id=pad_token_id(base))
    openmp.release_threads()  # loading ran parallel regions on this thread, which trains elsewhere (spade.openmp)
    return trainer


def build_learner(
    settings: LearnerSettings,
    *,
    spec: RunSpec,
    queue: WorkQueue | None = None,
    world: World | None = None,
    on_designer_reward: RewardCallback | None = None,
    model_factory: Callable[[Path, torch.device], nn.Module] = load_policy,
    base_model_dir: Path | None = None,
) -> Learner:
    """A ready learner on rank 0 (or the single process): trainer, checkpoints, publisher and queue, resumed.

    Args:
        settings: The learner settings.
        spec: The run spec (embedded: the run's; distributed: ``run_spec_from_memory``). Settings that
            contradict it raise ``SpecContradiction`` before anything is loaded.
        queue: An existing queue (embedded mode shares one); default: built from ``settings.queue``.
        world: The process group; default: joined from the ``torchrun`` environment. The other ranks
            are built by ``build_follower`` (``build_rank`` picks).
        on_designer_reward: Callback for each scored designer attempt.
        model_factory: Loads the policy from a checkpoint directory onto a device.
        base_model_dir: Overrides the base checkpoint (default: ``settings.model_path`` / dev model).

    Raises:
        SpecContradiction: The settings contradict the run spec.
        ResumeError: What is on disk would make the learner go back in time (``Learner.resume``).
        ValueError: ``world`` is not rank 0.
    """
    settings.check_spec(spec)
    world = world or init_world()
    if not world.is_main:
        raise ValueError(f"rank {world.rank} follows rank 0: build it with build_follower (or build_rank)")
    base = base_model_dir or resolve_base_model(settings)
    trainer = build_trainer(settings, spec, base, world, model_factory)
    checkpoints = CheckpointManager(
        settings.checkpoint_dir, settings.keep_checkpoints, base_model_dir=base, world=world
    )
    queue = queue or make_queue(settings.queue)
    publisher = WeightPublisher(
        settings.inference_urls,
        queue,
        weights_dir=settings.weights_dir,
        keep=settings.keep_weights,
        retry=settings.retry,
        timeout_s=settings.publish_timeout_s,
        require_all=settings.require_all_workers,
        spec_id=spec.spec_id,
        inference=settings.inference,
    )
    learner = Learner(
        settings,
        spec,
        queue,
        trainer,
        checkpoints,
        publisher,
        base_model_dir=base,
        on_designer_reward=on_designer_reward,
    )
    if settings.resume:
        learner.resume()
    else:
        learner.start_fresh()
    return learner


def build_follower(
    settings: LearnerSettings,
    *,
    spec: RunSpec,
    world: World,
    model_factory: Callable[[Path, torch.device], nn.Module] = load_policy,
    base_model_dir: Path | None = None,
) -> Follower:
    """A non-main rank under ``torchrun``: its shard of the trainer, resumed from the same checkpoint as rank 0.

    Raises:
        SpecContradiction: The settings contradict the run spec.
        ResumeError: The checkpoint belongs to another run spec.
    """
    settings.check_spec(spec)
    base = base_model_dir or resolve_base_model(settings)
    trainer = build_trainer(settings, spec, base, world, model_factory)
    checkpoints = CheckpointManager(
        settings.checkpoint_dir, settings.keep_checkpoints, base_model_dir=base, world=world
    )
    follower = Follower(spec.spec_id, trainer, VersionWriter(trainer, checkpoints, settings.weights_dir, base))
    if settings.resume:
        follower.resume()
    return follower


def build_rank(
    settings: LearnerSettings,
    *,
    spec: RunSpec,
    on_designer_reward: RewardCallback | None = None,
) -> Learner | Follower:
    """This process's part under ``torchrun`` (or alone): the ``Learner`` on rank 0, a ``Follower`` elsewhere.

    Raises:
        SpecContradiction: The settings contradict the run spec.
        ResumeError: What is on disk would make the learner go back in time.
    """
    world = init_world()
    if world.is_main:
        return build_learner(settings, spec=spec, world=world, on_designer_reward=on_designer_reward)
    return build_follower(settings, spec=spec, world=world)


async def close_learner(learner: Learner, *, close_queue: bool = True) -> None:
    """Release the learner's HTTP clients (and its queue when it owns it)."""
    if learner.publisher is not None:
        await learner.publisher.close()
    if close_queue:
        await learner.queue.close()


def describe(settings: LearnerSettings) -> dict[str, Any]:
    """Settings as JSON data (for the start-up log line)."""
    return json.loads(settings.model_dump_json())
