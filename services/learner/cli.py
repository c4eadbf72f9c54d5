"""``spade serve learner``: run the learner service until interrupted (or for ``--max-steps``).

Single process: ``spade serve learner``. Sharded over GPUs/nodes with FSDP2:
``torchrun --nproc_per_node 8 -m services.learner.cli --max-steps 400``.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import click

from services.learner.settings import LearnerSettings
from spade.config import ConfigError
from spade.serving import lifecycle
from spade.serving.logs import get_logger
from spade.serving.run import config_option, configure_logs, log_level_option, run_until_signalled, settings_or_exit

logger = get_logger(__name__)


async def _serve(settings: LearnerSettings, max_steps: int | None, stop: asyncio.Event) -> None:
    from spade.memory.client import MemoryClient

    memory = MemoryClient.from_endpoint(settings.memory)
    try:
        await _serve_with(settings, memory, max_steps, stop)
    finally:
        await memory.close()


async def _serve_with(settings: LearnerSettings, memory: Any, max_steps: int | None, stop: asyncio.Event) -> None:
    from services.learner.collective import Follower
    from services.learner.distributed import close_world
    from services.learner.versions import ResumeError
    from services.learner.wiring import (
        build_rank,
        close_learner,
        describe,
        memory_reward_sink,
        run_spec_from_memory,
    )
    from spade.memory.errors import RunSpecConflict
    from spade.serving.startup import StoppedWhileWaiting

    try:
        spec = await run_spec_from_memory(settings, memory, stop)
    except StoppedWhileWaiting:
        logger.info("learner stopped before a run spec was stored")
        return
    except (ConfigError, RunSpecConflict) as exc:
        raise Refused(str(exc)) from None
    try:
        learner = build_rank(settings, spec=spec, on_designer_reward=memory_reward_sink(memory))
    except (ConfigError, ResumeError) as exc:
        raise Refused(str(exc)) from None
    if isinstance(learner, Follower):
        await asyncio.to_thread(learner.follow)
        close_world()  # only after a clean stop: leaving while peers are inside a collective can hang them
        return
    lifecycle.started(
        f"learner starting at weight version {learner.version} under run spec {spec.spec_id}: "
        f"{settings.agent_groups_per_step} groups of G={spec.group_size} per step, publishing every "
        f"{settings.publish_every}, checkpoints in {settings.checkpoint_dir}, weights in {settings.weights_dir}",
        settings=describe(settings),
        spec_id=spec.spec_id,
        version=learner.version,
        groups_per_step=settings.agent_groups_per_step,
        group_size=spec.group_size,
    )
    from spade.inference.discovery import following

    publisher = learner.publisher
    try:
        async with following(settings.inference_discovery, publisher.set_workers if publisher else lambda _: None):
            await learner.run(max_steps=max_steps, stop=stop)
    finally:
        await close_learner(learner)
    close_world()
    lifecycle.note_finished(
        f"learner stopped at weight version {learner.version}",
        version=learner.version,
        checkpointed=learner.checkpointed_version,
    )


class Refused(Exception):
    """The learner cannot start as configured (the message is for a person: one line per problem)."""


@click.command("learner")
@config_option
@click.option("--max-steps", type=click.IntRange(min=1), default=None, help="Stop after this many trained steps.")
@click.option(
    "--dev", is_flag=True, default=None, help="Dev mode: allow the embedded default model (SPADE_LEARNER_DEV_MODE)."
)
@log_level_option
def serve(config_file: Path | None, max_steps: int | None, dev: bool | None, log_level: str | None) -> None:
    """The learner: SPADE rewards, GRPO for both roles, checkpoints, weight publishing.

    Configured through SPADE_LEARNER_* environment variables (nested with __) or --config, e.g.
    SPADE_LEARNER_MODEL_PATH, SPADE_LEARNER_INFERENCE_URLS='["http://host:30000"]',
    SPADE_LEARNER_QUEUE__URL=redis://redis:6379/0, SPADE_LEARNER_LOSS__KL_COEF=0.005,
    SPADE_LEARNER_MEMORY__TARGET=memory:50052 (the run spec is read there at start; G, k, the
    temperature and the reward constants come from it). SIGTERM: the step being filled is abandoned,
    the state checkpointed, and the learner exits.
    """
    configure_logs("learner", log_level)
    settings = settings_or_exit(LearnerSettings, config_file, dev_mode=dev)
    if settings.queue.kind == "inprocess" and not settings.dev_mode:
        raise click.UsageError(
            "a standalone learner with the in-process queue would never receive a sample; set "
            "SPADE_LEARNER_QUEUE__KIND=redis (the embedded `spade run` shares one in-process queue)"
        )
    from spade.dependencies import endpoint, queue, wait_for

    # The inference workers are retried by the publisher itself.
    wait_for([queue(settings.queue), endpoint(settings.memory)])
    try:
        run_until_signalled(lambda stop: _serve(settings, max_steps, stop))
    except Refused as exc:
        click.echo(f"the learner refuses to start:\n{exc}", err=True)
        raise SystemExit(2) from None


if __name__ == "__main__":
    serve(sys.argv[1:])
