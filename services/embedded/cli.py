"""``spade run``: the whole self-play loop in one process, with progress bars and a run report."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import click

from spade.envs.types import SETTINGS


class _RunCommand(click.Command):
    """``spade run``, whose help ends with the default run's departures from the paper (computed on demand)."""

    def format_epilog(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        from services.embedded.departures import departures
        from services.embedded.settings import RunSettings

        lines = departures(RunSettings(run_dir=Path("runs/help")))
        formatter.write_paragraph()
        formatter.write_text(
            "The default run is small enough for a laptop and departs from the paper (--preset paper-game / "
            "paper-tool sets the paper's values; configs/README.md gives each value's source):"
        )
        with formatter.indentation():
            for line in lines:
                formatter.write_text(f"- {line}")


@click.command("run", cls=_RunCommand)
@click.option("--config", type=click.Path(exists=True, dir_okay=False, path_type=Path), help="YAML/JSON run settings.")
@click.option(
    "--preset",
    type=click.Choice(["paper-game", "paper-tool"]),
    default=None,
    help="Start from the paper's values (the config file, environment and other flags go on top).",
)
@click.option("--steps", type=click.IntRange(min=1), default=None, help="Learner steps (weight versions).")
@click.option("--setting", type=click.Choice(SETTINGS), default=None, help="Which kind of environments.")
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path), default=None, help="Output directory.")
@click.option(
    "--designer",
    "designer_mode",
    type=click.Choice(["policy", "frozen", "off"]),
    default=None,
    help="policy: trained designer; frozen: designs, never trained; off: agent only (static-pool baseline).",
)
@click.option(
    "--pool",
    type=click.Path(exists=True, path_type=Path),
    default=None,
    help="Static pool played all run: envs.jsonl, a run dir, or a dir of env files (validated first).",
)
@click.option(
    "--designer-pool",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="Design from a directory of designer answers (scored, never trained).",
)
@click.option(
    "--designer-init",
    type=click.Choice(["base", "warm"]),
    default=None,
    help="Start from the warm-started model (default; `spade warmstart`, built once and cached) or the base model.",
)
@click.option(
    "--held-out-eval/--no-held-out-eval",
    default=None,
    help="Score held-out envs before the first step and after the last (default: on).",
)
@click.option("--no-corpus", is_flag=True, default=False, help="Corpus-free designer (the paper's ablation).")
@click.option("--no-memory", is_flag=True, default=False, help="Memory-free designer (the paper's ablation).")
@click.option("--eval-every", type=click.IntRange(min=0), default=None, help="Evaluate every N steps (0: never).")
@click.option(
    "--eval-suite",
    type=click.Choice(["pool", "reasoning-gym", "bfcl-multi-turn"]),
    default=None,
    help="Suite of the in-run eval (default: pool, held-out seeds of the starting pool).",
)
@click.option("--eval-limit", type=click.IntRange(min=1), default=None, help="Items of the in-run eval's slice.")
@click.option(
    "--model-path",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="HF checkpoint directory of the policy (default: SmolLM2-135M-Instruct).",
)
@click.option("-v", "--verbose", is_flag=True, help="Log every service's progress.")
def run(
    config: Path | None,
    preset: str | None,
    steps: int | None,
    setting: str | None,
    run_dir: Path | None,
    designer_mode: str | None,
    pool: Path | None,
    designer_pool: Path | None,
    designer_init: str | None,
    held_out_eval: bool | None,
    no_corpus: bool,
    no_memory: bool,
    eval_every: int | None,
    eval_suite: str | None,
    eval_limit: int | None,
    model_path: Path | None,
    verbose: bool,
) -> None:
    """Run the whole SPADE loop in embedded mode (SQLite, in-process queues, CPU model and learner).

    Baselines: --designer off --pool FILE_OR_DIR trains the agent alone on a static pool; --designer
    frozen designs without training the designer; --designer-pool DIR sends designer answers from
    files through the real pipeline; --no-corpus and --no-memory are the designer's ablations.
    """
    from services.embedded.system import KEEP_MEMORY_SWITCH, keep_freed_memory
    from spade.config import turned_off

    if not turned_off(KEEP_MEMORY_SWITCH):
        keep_freed_memory()  # first, before any thread has an allocator arena of its own
    from pydantic import ValidationError
    from rich.console import Console
    from rich.markup import escape

    from services.embedded.console import configure_output, progress_bars
    from services.embedded.metrics import console_line
    from services.embedded.runner import RunSetupError
    from services.embedded.runner import run as run_loop
    from services.embedded.settings import RunSettings
    from services.embedded.system import served_weights
    from spade.config import ConfigError, describe_error

    flags: dict[str, Any] = {
        "preset": preset,
        "steps": steps,
        "setting": setting,
        "run_dir": run_dir,
        "designer_mode": designer_mode,
        "pool": pool,
        "designer_pool": designer_pool,
        "designer_init": designer_init,
        "held_out_eval": held_out_eval,
        "corpus": False if no_corpus else None,
        "memory_examples": False if no_memory else None,
        "eval_every": eval_every,
        "eval_suite": eval_suite,
        "eval_limit": eval_limit,
        "model_path": model_path,
    }
    try:
        settings = RunSettings.load(config, **flags)
    except (ValidationError, ConfigError) as exc:
        raise click.UsageError(f"invalid run settings:\n{describe_error(exc, RunSettings)}") from None
    configure_output("run", verbose)
    console = Console()
    console.print(f"[bold]SPADE[/bold] embedded run → {escape(str(settings.run_dir))}")
    weights = served_weights(settings)
    if weights != "float32":
        console.print(
            f"serving {weights} weights: faster decoding, but a seeded run's plays vary from run "
            "to run (SPADE_RUN_INFERENCE__WEIGHTS=float32 repeats them)"
        )
    with progress_bars(console) as (bars, progress):

        def on_step(record: dict[str, Any]) -> None:
            if record.get("step"):
                bars.console.print(escape(console_line(record, settings.steps)))
            else:
                figures = ", ".join(f"{k} = {v:.3f}" for k, v in record.items() if k.endswith("/overall"))
                bars.console.print(escape(f"held-out eval before the first step: {figures or 'skipped'}"))

        try:
            result = asyncio.run(run_loop(settings, progress, on_step))
        except RunSetupError as exc:
            raise click.ClickException(str(exc)) from None
    if result.held_out is not None:
        from services.embedded.metrics import held_out_sentence

        console.print(escape(held_out_sentence(result.held_out)))
    if result.departures:
        console.print(f"departs from the paper in {len(result.departures)} values (listed in the report)")
    console.print(f"run spec: {result.spec_id}\nreport: {result.report}\ncheckpoint: {result.checkpoint}")
