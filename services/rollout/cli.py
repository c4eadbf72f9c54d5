"""``spade serve rollout``: run one rollout worker until SIGTERM/SIGINT.

On SIGTERM the worker stops claiming slots, lets the slots in flight finish for
``shutdown_grace_s``, cancels the rest (their finished plays are kept, their leases handed back at
once) and exits. A configuration that contradicts the run spec exits with status 2, one line per field.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import click

from services.rollout.settings import RolloutSettings
from spade.config import ConfigError
from spade.serving import lifecycle
from spade.serving.logs import get_logger
from spade.serving.run import config_option, configure_logs, log_level_option, run_until_signalled, settings_or_exit

log = get_logger(__name__)


async def _serve(settings: RolloutSettings, stop: asyncio.Event) -> None:
    from services.rollout.standalone import standalone_worker
    from spade.memory.errors import RunSpecConflict
    from spade.serving.startup import StoppedWhileWaiting

    try:
        async with standalone_worker(settings, stop=stop) as worker:
            spec = worker.spec
            lifecycle.started(
                f"rollout worker {settings.consumer_name} serving (group {settings.consumer_group}, spec "
                f"{spec.spec_id}: G={spec.group_size}, k={spec.window_versions_game}/{spec.window_versions_tool} "
                f"game/tool, {spec.agent_max_turns} turns)",
                settings=settings,
                consumer=settings.consumer_name,
                spec_id=spec.spec_id,
            )
            await worker.run(stop)
            lifecycle.note_finished(f"rollout worker {settings.consumer_name} stopped")
    except StoppedWhileWaiting as exc:
        log.info("rollout worker %s %s", settings.consumer_name, exc)
    except (ConfigError, RunSpecConflict) as exc:
        click.echo("the rollout's settings contradict the run spec:", err=True)
        click.echo(str(exc), err=True)
        raise SystemExit(2) from None


@click.command()
@config_option
@click.option("--dev", "dev_mode", is_flag=True, default=None, help="Allow unsafe defaults (local development).")
@log_level_option
def serve(config_file: Path | None, dev_mode: bool | None, log_level: str | None) -> None:
    """The rollout workers (the reasoning agent): play envs from envs.ready, publish samples."""
    configure_logs("rollout", log_level)
    settings = settings_or_exit(RolloutSettings, config_file, dev_mode=dev_mode)
    # Dependencies are waited for while building the worker (SIGTERM ends the wait): the queue, the
    # state database and the memory first, then the run spec is checked, then the sandbox and inference.
    run_until_signalled(lambda stop: _serve(settings, stop))
