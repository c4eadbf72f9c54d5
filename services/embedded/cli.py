"""``spade run``: the whole self-play loop in one process, with progress bars and a run report."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

import click


@click.command("run")
@click.option("--config", type=click.Path(exists=True, dir_okay=False, path_type=Path), help="YAML/JSON run settings.")
@click.option("--steps", type=click.IntRange(min=1), default=None, help="Learner steps (weight versions).")
@click.option("--setting", type=click.Choice(["game", "tool"]), default=None, help="Which kind of environments.")
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path), default=None, help="Output directory.")
@click.option("-v", "--verbose", is_flag=True, help="Log every service's progress.")
def run(config: Path | None, steps: int | None, setting: str | None, run_dir: Path | None, verbose: bool) -> None:
    """Run the whole SPADE loop in embedded mode (SQLite, in-process queues, CPU model and learner)."""
    from pydantic import ValidationError
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

    from services.embedded.runner import run as run_loop
    from services.embedded.settings import RunSettings
    from spade.config import ConfigError, describe_error

    try:
        settings = RunSettings.load(config, steps=steps, setting=setting, run_dir=run_dir)
    except (ValidationError, ConfigError) as exc:
        raise click.UsageError(f"invalid run settings:\n{describe_error(exc, RunSettings)}") from None
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    if not verbose:
        # Our own bars say what is happening; the libraries' per-load bars would interleave with them.
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    console = Console()
    console.print(f"[bold]SPADE[/bold] embedded run → {settings.run_dir}")
    columns = (TextColumn("{task.description:<10}"), BarColumn(), TextColumn("{task.completed:g}/{task.total:g}"))
    with Progress(*columns, TimeElapsedColumn(), console=console) as bars:
        tasks: dict[str, TaskID] = {}

        def progress(phase: str, done: float, total: float) -> None:
            if phase not in tasks:
                tasks[phase] = bars.add_task(phase, total=total)
            bars.update(tasks[phase], completed=done, total=total)

        result = asyncio.run(run_loop(settings, progress))
    for record in result.steps:
        console.print(
            f"step {record['step']}: designer valid {record['designer/valid']}/{record['designer/attempts']}, "
            f"agent win rate {record['agent/win_rate']}, trained={record['learner/trained']}, "
            f"weights v{record['inference/weight_version']}"
        )
    console.print(f"report: {result.report}\ncheckpoint: {result.checkpoint}")
