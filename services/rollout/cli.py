"""``spade serve rollout``: run one rollout worker until SIGTERM/SIGINT (its current plays finish first)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import click

from services.rollout.settings import RolloutSettings
from spade.serving.run import config_option, run_until_signalled, settings_or_exit


async def _serve(settings: RolloutSettings, stop: asyncio.Event) -> None:
    from services.rollout.wiring import rollout_worker

    async with rollout_worker(settings) as worker:
        logging.getLogger("spade.rollout").info(
            "rollout worker %s serving (group %s, G=%d, k=%d)",
            settings.consumer_name,
            settings.consumer_group,
            settings.group_size,
            settings.window_versions,
        )
        await worker.run(stop)


@click.command()
@config_option
@click.option("--dev", "dev_mode", is_flag=True, default=None, help="Allow unsafe defaults (local development).")
@click.option("--log-level", default="INFO", show_default=True, help="Python logging level.")
def serve(config_file: Path | None, dev_mode: bool | None, log_level: str) -> None:
    """The rollout workers (the reasoning agent): play envs from envs.ready, publish samples."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = settings_or_exit(RolloutSettings, config_file, dev_mode=dev_mode)
    from spade.dependencies import endpoint, inference, postgres, queue, wait_for

    wait_for(
        [
            queue(settings.queue),
            postgres(settings.state_url),
            endpoint(settings.sandbox),
            endpoint(settings.memory),
            *inference(settings.inference_urls),
        ]
    )
    run_until_signalled(lambda stop: _serve(settings, stop))
