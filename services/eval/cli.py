"""``spade eval``: score a checkpoint or a server on a held-out suite; ``spade eval compare A B``.

Bad input (unknown suite, missing checkpoint, server down, an out directory of another run) prints
one line on stderr and exits non-zero, never a traceback. An interrupted eval keeps every finished
item; the same command resumes it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any, NoReturn

import click

from spade.serving.logs import configure_from_env

SUITE_NAMES = ("reasoning-gym", "bfcl-multi-turn", "pool")

EXIT_USAGE = 2
"""Bad arguments or settings."""

EXIT_FAILED = 1
"""The eval could not start or stopped (server down, sandbox broken, out directory in use)."""


def _fail(message: str, code: int = EXIT_FAILED) -> NoReturn:
    click.echo(f"spade eval: {message}", err=True)
    sys.exit(code)


def _quiet_libraries(verbose: bool) -> None:
    configure_from_env("eval", level=logging.INFO if verbose else logging.WARNING, default_format="text")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if not verbose:
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
        # BFCL's executor and reasoning-gym's scorers log and print freely; our records keep what matters.
        # The client's retry warnings too: a server that stays down ends in one line of ours.
        for name in ("bfcl_eval", "reasoning_gym", "httpx", "spade.inference.client"):
            logging.getLogger(name).setLevel(logging.ERROR)


def default_out(suite: str, seed: int, model: str | None) -> Path:
    """``eval-runs/<suite>-seed<seed>-<model>``: rerunning the same command resumes the same run."""
    label = "default-model" if model is None else re.sub(r"[^A-Za-z0-9._-]+", "_", model.rstrip("/"))[-60:]
    return Path("eval-runs") / f"{suite}-seed{seed}-{label.strip('_') or 'model'}"


@click.group("eval", invoke_without_command=True)
@click.option("--model", default=None, help="Checkpoint directory or SGLang-compatible server URL (default: SmolLM2).")
@click.option("--suite", default=None, help="reasoning-gym, bfcl-multi-turn or pool.")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Only the first N items (a quick look).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the item set.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON on stdout.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None, help="Results directory.")
@click.option("--pool", "pool_source", default=None, help="pool suite: run dir, memory.db, envs.jsonl or a URL.")
@click.option("--tokenizer", type=click.Path(path_type=Path), default=None, help="Chat template dir (URL models).")
@click.option("--config", type=click.Path(dir_okay=False, path_type=Path), default=None, help="YAML/JSON settings.")
@click.option("-v", "--verbose", is_flag=True, help="Log progress of every part.")
@click.pass_context
def eval_group(
    ctx: click.Context,
    model: str | None,
    suite: str | None,
    limit: int | None,
    seed: int,
    as_json: bool,
    out: Path | None,
    pool_source: str | None,
    tokenizer: Path | None,
    config: Path | None,
    verbose: bool,
) -> None:
    """Score a checkpoint or a server on a held-out suite, per item with bootstrap intervals.

    \b
    spade eval --suite reasoning-gym --limit 20
    spade eval --model runs/x/last_checkpoint --suite pool --pool runs/x
    spade eval --model http://gpu-node:30000 --suite bfcl-multi-turn --tokenizer ./Qwen3-4B
    spade eval compare eval-runs/A eval-runs/B
    """
    if ctx.invoked_subcommand is not None:
        return
    if suite is None:
        _fail("--suite is required: choose reasoning-gym, bfcl-multi-turn or pool", EXIT_USAGE)
    if suite not in SUITE_NAMES:
        _fail(f"unknown suite {suite!r}; choose reasoning-gym, bfcl-multi-turn or pool", EXIT_USAGE)
    _quiet_libraries(verbose)
    from pydantic import ValidationError

    from services.eval.settings import EvalSettings
    from services.eval.wiring import EvalRequest
    from spade.config import ConfigError, describe_error

    try:
        settings = EvalSettings.load(config)
    except (ValidationError, ConfigError) as exc:
        _fail("invalid settings: " + describe_error(exc, EvalSettings).replace("\n", "; "), EXIT_USAGE)
    request = EvalRequest(
        suite=suite,
        model=model,
        seed=seed,
        limit=limit,
        out=out or default_out(suite, seed, model),
        tokenizer=tokenizer,
    )
    _run(request, settings, pool_source, as_json)


def _run(request: Any, settings: Any, pool_source: str | None, as_json: bool) -> None:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from services.eval.core.records import ItemResult
    from services.eval.store import StoreError
    from services.eval.wiring import EvalSetupError, run_eval
    from spade.inference.client import InferenceError
    from spade.sandbox.errors import SandboxFault

    err = Console(stderr=True)
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("mean {task.fields[mean]}"),
        TimeElapsedColumn(),
    )
    progress = Progress(*columns, console=err, transient=False)
    state: dict[str, Any] = {"task": None, "sum": 0.0, "n": 0}

    def stop() -> None:
        if state["task"] is not None:  # stopping a bar never started would print an empty line
            progress.stop()

    def on_start(todo: int, resumed: int) -> None:
        if resumed:
            err.print(f"resuming {request.out}: {resumed} items already done", soft_wrap=True)
        progress.start()
        state["task"] = progress.add_task(request.suite, total=todo, mean="-")

    def on_item(item: ItemResult) -> None:
        state["sum"] += item.score
        state["n"] += 1
        progress.update(state["task"], advance=1, mean=f"{state['sum'] / state['n']:.3f}")

    try:
        outcome = asyncio.run(run_eval(request, settings, pool_source=pool_source, on_start=on_start, on_item=on_item))
    except (EvalSetupError, StoreError) as exc:
        stop()
        _fail(str(exc))
    except InferenceError as exc:
        stop()
        _fail(f"the inference server failed ({exc}); finished items are saved, rerun the same command to resume")
    except SandboxFault as exc:
        stop()
        _fail(f"the sandbox failed ({exc}); finished items are saved, rerun the same command to resume")
    except KeyboardInterrupt:
        stop()
        _fail(f"interrupted; finished items are saved in {request.out}, rerun the same command to resume", 130)
    stop()
    if as_json:
        click.echo(json.dumps({**outcome.summary.to_dict(), "out": str(outcome.directory)}, indent=2))
        return
    _print_summary(outcome.summary, outcome.directory)


def _print_summary(summary: Any, directory: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    h = summary.header
    console = Console()
    console.print(
        f"[bold]{h.suite}[/] seed {h.seed} · model {h.model} · weights {h.weight_version} · "
        f"sampling {json.dumps(h.sampling)}",
        soft_wrap=True,
    )
    table = Table(show_edge=False)
    for column in ("category", "n", "mean", "95% interval"):
        table.add_column(column, justify="left" if column == "category" else "right")
    for name, iv in summary.categories.items():
        table.add_row(name, str(iv.n), f"{iv.mean:.3f}", f"[{iv.low:.3f}, {iv.high:.3f}]")
    console.print(table)
    if summary.errors:
        console.print(f"{summary.errors} items scored 0 without a verdict (see 'error' in items.jsonl)")
    console.print(f"results: {directory}")


@eval_group.command("compare")
@click.argument("a", type=click.Path(path_type=Path))
@click.argument("b", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the comparison as JSON on stdout.")
def compare_cmd(a: Path, b: Path, as_json: bool) -> None:
    """Pair two eval runs item by item and report B - A with paired bootstrap intervals."""
    from rich.console import Console
    from rich.table import Table

    from services.eval.core.compare import CompareError, compare
    from services.eval.store import StoreError, read_run

    try:
        result = compare(read_run(a), read_run(b))
    except (StoreError, CompareError) as exc:
        _fail(str(exc))
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2))
        return
    console = Console()
    console.print(f"A: {result.a.model} (weights {result.a.weight_version})")
    console.print(f"B: {result.b.model} (weights {result.b.weight_version})")
    console.print(f"{result.a.suite}, seed {result.a.seed}: {result.paired} paired items")
    if result.only_a or result.only_b:
        console.print(f"left out: {len(result.only_a)} items only in A, {len(result.only_b)} only in B")
    for note in result.notes:
        console.print(f"note: {note}")
    table = Table(show_edge=False)
    for column in ("category", "n", "A", "B", "B - A", "95% interval"):
        table.add_column(column, justify="left" if column == "category" else "right")
    for name, iv in result.differences.items():
        mean_a, mean_b = result.means[name]
        table.add_row(
            name, str(iv.n), f"{mean_a:.3f}", f"{mean_b:.3f}", f"{iv.mean:+.3f}", f"[{iv.low:+.3f}, {iv.high:+.3f}]"
        )
    console.print(table)
