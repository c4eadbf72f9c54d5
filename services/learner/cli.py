"""``spade serve learner``: run the learner service until interrupted (or for ``--max-steps``).

Single process: ``spade serve learner``. Sharded over GPUs/nodes with FSDP2:
``torchrun --nproc_per_node 8 -m services.learner.cli --max-steps 400``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from pathlib import Path

import click

from services.learner.settings import LearnerSettings
from spade.serving.run import config_option, run_until_signalled, settings_or_exit

logger = logging.getLogger("services.learner")


async def _serve(settings: LearnerSettings, max_steps: int | None, stop: asyncio.Event) -> None:
    from services.learner.wiring import build_learner, close_learner, describe

    learner = build_learner(settings)
    if not learner.world.is_main:
        await asyncio.to_thread(learner.follow)
        return
    logger.info("learner starting at weight version %d: %s", learner.version, json.dumps(describe(settings)))
    from spade.inference.discovery import following

    publisher = learner.publisher
    try:
        async with following(settings.inference_discovery, publisher.set_workers if publisher else lambda _: None):
            await learner.run(max_steps=max_steps, stop=stop)
    finally:
        await close_learner(learner)


@click.command("learner")
@config_option
@click.option("--max-steps", type=click.IntRange(min=1), default=None, help="Stop after this many trained steps.")
@click.option(
    "--dev", is_flag=True, default=None, help="Dev mode: allow the embedded default model (SPADE_LEARNER_DEV_MODE)."
)
@click.option("--log-level", default="INFO", show_default=True, help="Python logging level.")
def serve(config_file: Path | None, max_steps: int | None, dev: bool | None, log_level: str) -> None:
    """The learner: SPADE rewards, GRPO for both roles, checkpoints, weight publishing.

    Configured through SPADE_LEARNER_* environment variables (nested with __) or --config, e.g.
    SPADE_LEARNER_MODEL_PATH, SPADE_LEARNER_INFERENCE_URLS='["http://host:30000"]',
    SPADE_LEARNER_QUEUE__URL=redis://redis:6379/0, SPADE_LEARNER_LOSS__KL_COEF=0.005.
    """
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    settings = settings_or_exit(LearnerSettings, config_file, dev_mode=dev)
    if settings.queue.kind == "inprocess" and not settings.dev_mode:
        raise click.UsageError(
            "a standalone learner with the in-process queue would never receive a sample; set "
            "SPADE_LEARNER_QUEUE__KIND=redis (the embedded `spade run` shares one in-process queue)"
        )
    from spade.dependencies import queue, wait_for

    wait_for([queue(settings.queue)])  # the inference workers are retried by the publisher itself
    run_until_signalled(lambda stop: _serve(settings, max_steps, stop))


if __name__ == "__main__":
    serve(sys.argv[1:])
