"""``spade warmstart``: build (or load) the cached designer warm start, with progress bars."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import click

from spade.envs.types import SETTINGS


def _figures(label: str, summary: dict[str, Any] | None) -> str:
    if not summary:
        return f"{label}: not evaluated"
    return (
        f"{label}: {summary['valid']}/{summary['prompts']} valid ({summary['validity']:.0%}), "
        f"{summary['distinct_valid_programs']} distinct valid program(s), "
        f"{summary['valid_copies_of_training']} copied from training; outcomes {summary['outcomes']}"
    )


@click.command("warmstart")
@click.option("--config", type=click.Path(exists=True, dir_okay=False, path_type=Path), help="A run settings file.")
@click.option("--setting", type=click.Choice(SETTINGS), default=None, help="Which designer role.")
@click.option(
    "--model-path",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="The base checkpoint (default: SmolLM2-135M-Instruct).",
)
@click.option("--pairs", type=click.IntRange(min=1), default=None, help="Pairs planned before validation.")
@click.option("--epochs", type=click.IntRange(min=1), default=None, help="Passes over the valid pairs.")
@click.option("--prompt-tokens", type=click.IntRange(min=256), default=None, help="The designer's prompt budget.")
@click.option("--eval/--no-eval", "evaluate", default=True, help="Measure validity before and after (default: on).")
@click.option("--force", is_flag=True, help="Rebuild even when a cached warm start exists.")
@click.option("-v", "--verbose", is_flag=True, help="Log every step.")
def warmstart(
    config: Path | None,
    setting: str | None,
    model_path: Path | None,
    pairs: int | None,
    epochs: int | None,
    prompt_tokens: int | None,
    evaluate: bool,
    force: bool,
    verbose: bool,
) -> None:
    """Fine-tune the designer role on validated (designer prompt -> family answer) pairs, cached.

    The prompts are the embedded run's (its settings file, --config, gives the budgets), the answers
    environment families' envs, each validated in the sandbox first. The checkpoint is cached in the
    model cache under a key of everything it depends on; a second call returns it at once.
    """
    # Before torch loads OpenMP: spinning worker threads waste most of a busy CPU (a decode step
    # measured 12x slower with two spinning threads than with passive ones on a loaded 2-core machine).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from pydantic import ValidationError
    from rich.console import Console
    from rich.markup import escape

    from services.embedded.console import configure_output, progress_bars
    from services.embedded.settings import RunSettings
    from services.embedded.warmstart.build import WarmStartError
    from services.embedded.warmstart.cache import ensure_warm_start, read_record
    from services.embedded.warmstart.settings import WarmStartSettings
    from spade.config import ConfigError, describe_error

    run_flags = {"setting": setting, "model_path": model_path}
    own: dict[str, Any] = {"pairs": pairs, "epochs": epochs, "max_prompt_tokens": prompt_tokens, "evaluate": evaluate}
    try:
        run = RunSettings.load(config, **run_flags)
    except (ValidationError, ConfigError) as exc:
        raise click.UsageError(f"invalid run settings:\n{describe_error(exc, RunSettings)}") from None
    try:
        settings = WarmStartSettings.from_run(run, **{k: v for k, v in own.items() if v is not None})
    except ValidationError as exc:
        raise click.UsageError(f"invalid warm start settings:\n{describe_error(exc)}") from None
    configure_output("warmstart", verbose)
    console = Console()
    console.print(f"[bold]SPADE[/bold] designer warm start ({settings.setting}, {settings.pairs} pairs planned)")
    started = time.perf_counter()
    with progress_bars(console) as (_, progress):
        try:
            directory = ensure_warm_start(settings, progress=progress, force=force)
        except WarmStartError as exc:
            raise click.ClickException(str(exc)) from None
    record = read_record(directory) or {}
    built = record.get("pairs", {})
    loss = record.get("loss", {})
    sft = record.get("sft", {})
    console.print(f"checkpoint: {escape(str(directory))}")
    console.print(
        f"pairs: {built.get('valid', 0)} valid of {built.get('planned', 0)} planned "
        f"(invalid {built.get('invalid', {})}, over budget {built.get('too_long', 0)}); "
        f"{sft.get('steps', 0)} steps over {sft.get('epochs', 0)} epochs"
    )
    if loss.get("probe_before") is not None:
        console.print(
            f"answer loss on held-out probe pairs: {loss['probe_before']:.3f} -> {loss['probe_after']:.3f} "
            f"(training: first epoch {loss['train_first_epoch']:.3f}, last {loss['train_last_epoch']:.3f})"
        )
    evaluation = record.get("evaluation") or {}
    console.print(escape(_figures("before (base model)", evaluation.get("before"))))
    console.print(escape(_figures("after (warm start)", evaluation.get("after"))))
    wall, cpu = record.get("wall_s", {}), record.get("cpu_s", {})
    console.print(
        escape(f"built in {wall.get('total', 0):.0f} s wall, {cpu.get('total', 0):.0f} s CPU: {wall} / {cpu}")
    )
    console.print(f"this call took {time.perf_counter() - started:.0f} s")
