"""``spade cluster up|down|status|kill``: the distributed mode as processes of this machine (docs/distributed.md)."""

from __future__ import annotations

import contextlib
import json
import signal
from pathlib import Path
from typing import TYPE_CHECKING

import click

from services.cluster.envfile import DEFAULT_ENV_FILES

if TYPE_CHECKING:
    from services.cluster.runner import Cluster

env_file_option = click.option(
    "--env-file",
    "env_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    multiple=True,
    default=DEFAULT_ENV_FILES,
    show_default=True,
    help="An env file every process reads; repeat it for several, a later file's lines winning "
    "(variables already in the environment win over every file).",
)


def _cluster(env_file: tuple[Path, ...]) -> Cluster:
    from pydantic import ValidationError

    from services.cluster.envfile import EnvFileError
    from services.cluster.runner import Cluster
    from services.cluster.settings import ClusterSettings
    from spade.config import describe_error

    try:
        return Cluster(env_file)
    except EnvFileError as exc:
        raise click.ClickException(str(exc)) from None
    except ValidationError as exc:
        problems = describe_error(exc, ClusterSettings)
        raise click.ClickException(f"invalid SPADE_CLUSTER_* settings:\n{problems}") from None


@click.group()
def cluster() -> None:
    """Run every service as a process of this machine, from one env file."""


@cluster.command()
@env_file_option
def up(env_file: tuple[Path, ...]) -> None:
    """Start what is not running, in order, each waited for until healthy; seed the pool."""
    from services.cluster.runner import ClusterError

    runner = _cluster(env_file)
    try:
        runner.up()
    except ClusterError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"cluster up: logs in {runner.log_dir}, keys in {runner.run_dir / 'keys.env'}")


@cluster.command()
@env_file_option
def down(env_file: tuple[Path, ...]) -> None:
    """Stop every process (SIGTERM, then SIGKILL after SPADE_CLUSTER_STOP_GRACE_S)."""
    _cluster(env_file).down()
    click.echo("cluster down")


@cluster.command()
@env_file_option
@click.option("--json", "as_json", is_flag=True, help="One JSON object (for scripts) instead of the table.")
@click.option("--watch", is_flag=True, help="Redraw every --interval seconds until interrupted (Ctrl-C).")
@click.option(
    "--interval", type=click.FloatRange(min=0.5), default=5.0, show_default=True, help="Seconds between redraws."
)
@click.option(
    "--window-min",
    type=click.FloatRange(min=0.1, max=10_080),
    default=10.0,
    show_default=True,
    help="Minutes the plays-per-minute and designer-validity figures cover.",
)
def status(env_file: tuple[Path, ...], as_json: bool, watch: bool, interval: float, window_min: float) -> None:
    """What the cluster is doing: each process, the published weight version, the learner's buffer,
    each stream's pending and lag, plays per minute, designer validity, each rollout worker's slot,
    disk use (docs/distributed.md, "What `spade cluster status` shows")."""
    import time

    from services.cluster.status import render

    runner = _cluster(env_file)
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C ends --watch, also while a report is collected
        while True:
            report = runner.status(window_min)
            if as_json:
                click.echo(json.dumps(report, indent=None if watch else 2))
            else:
                if watch:
                    click.clear()
                for line in render(report):
                    click.echo(line)
            if not watch:
                return
            time.sleep(interval)


@cluster.command()
@env_file_option
@click.argument("name")
@click.option("--signal", "sig", type=click.Choice(["KILL", "TERM"]), default="KILL", show_default=True)
def kill(env_file: tuple[Path, ...], name: str, sig: str) -> None:
    """Signal one process (kill -9 by default); `spade cluster up` starts it again."""
    from services.cluster.runner import ClusterError

    try:
        pid = _cluster(env_file).kill(name, getattr(signal, f"SIG{sig}"))
    except ClusterError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"sent SIG{sig} to {name} (pid {pid})")
