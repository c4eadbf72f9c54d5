"""``spade serve rollout``: run one rollout worker until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from pathlib import Path

import click

from services.rollout.settings import RolloutSettings


async def _serve(settings: RolloutSettings) -> None:
    from services.rollout.wiring import rollout_worker

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
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
@click.option(
    "--config",
    "config_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="YAML/JSON file of rollout settings (wins over SPADE_ROLLOUT_* variables).",
)
@click.option("--log-level", default="INFO", show_default=True, help="Python logging level.")
def serve(config_path: Path | None, log_level: str) -> None:
    """The rollout workers (the reasoning agent): play envs from envs.ready, publish samples."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = RolloutSettings.load(config_path)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    asyncio.run(_serve(settings))
