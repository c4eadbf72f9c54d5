"""Command line of the memory: ``spade serve memory``, ``spade envs ...`` and ``spade runspec set|show``.

``spade envs list|show|export`` read the database directly (``--database-url`` or
``SPADE_MEMORY_DATABASE_URL``), so they work in embedded mode without a running service and never
change the data. ``spade runspec`` and ``spade envs seed`` talk to a running memory over gRPC
(``--memory`` host:port, ``--memory-key`` or ``SPADE_MEMORY_API_KEY``).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import click
from pydantic import ValidationError

from spade.envs.types import SETTINGS, Setting
from spade.memory.errors import MemoryServiceError
from spade.memory.records import EnvFilter, EnvStatus
from spade.serving.run import config_option, configure_logs, log_level_option

DEFAULT_DB = "sqlite:///spade-memory.db"


@click.command()
@config_option
@click.option("--dev", "dev_mode", is_flag=True, default=None, help="Dev mode: an open REST API without keys.")
@log_level_option
def serve(config_file: Path | None, dev_mode: bool | None, log_level: str | None) -> None:
    """Run the memory service: gRPC (spade.v1.Memory) and the REST API + web page, until SIGTERM/SIGINT.

    Configured by SPADE_MEMORY_* environment variables or --config (see services/memory/settings.py).
    """
    configure_logs("memory", log_level)
    from services.memory.settings import MemorySettings
    from services.memory.wiring import serve_forever
    from spade.serving.run import run_until_signalled, settings_or_exit

    settings = settings_or_exit(MemorySettings, config_file, dev_mode=dev_mode)
    from spade.config import ConfigError
    from spade.dependencies import postgres, wait_for

    wait_for([postgres(settings.database_url)])  # started with the database, not after it
    if not settings.migrate_on_start:  # started with the one-shot migration, not after it
        from services.memory.migrate import wait_for_schema

        wait_for_schema(settings.database_url)
    try:
        run_until_signalled(lambda stop: serve_forever(settings, stop))
    except (MemoryServiceError, ConfigError) as exc:  # a run spec the memory cannot take: one line
        click.echo(f"spade serve memory: {exc}", err=True)
        sys.exit(2)
    except OSError as exc:
        raise click.ClickException(str(exc)) from exc


# -- spade envs -------------------------------------------------------------------------------------


def _store(database_url: str) -> Any:
    from services.memory.store.sql import SqlStore, make_engine

    if database_url.startswith("sqlite:///"):
        path = Path(database_url.removeprefix("sqlite:///"))
        if not path.exists():
            raise click.ClickException(
                f"no memory database at {path}; pass --database-url or set SPADE_MEMORY_DATABASE_URL"
            )
    return SqlStore(make_engine(database_url))


database_option = click.option(
    "--database-url",
    envvar="SPADE_MEMORY_DATABASE_URL",
    default=DEFAULT_DB,
    show_default=True,
    help="SQLAlchemy URL of the memory database.",
)


def filter_options(f: Any) -> Any:
    for opt in reversed(
        [
            click.option("--setting", type=click.Choice(SETTINGS)),
            click.option("--skill"),
            click.option("--status", type=click.Choice([s.value for s in EnvStatus])),
            click.option("--min-regret", type=click.FloatRange(-1.0, 1.0)),
            click.option("--max-win-rate", type=click.FloatRange(0.0, 1.0)),
            click.option("-q", "--query", "q", help="Text in the code or hint."),
        ]
    ):
        f = opt(f)
    return f


def _filter(kw: dict[str, Any]) -> EnvFilter:
    return EnvFilter(
        setting=Setting.parse(kw["setting"]) if kw.get("setting") else None,
        skill=kw.get("skill"),
        status=EnvStatus(kw["status"]) if kw.get("status") else None,
        min_regret=kw.get("min_regret"),
        max_win_rate=kw.get("max_win_rate"),
        q=kw.get("q"),
    )


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


@click.group()
def envs() -> None:
    """Inspect the environment memory."""


@envs.command("list")
@database_option
@filter_options
@click.option("--limit", type=click.IntRange(1, 1000), default=50, show_default=True)
@click.option("--cursor", help="next cursor printed by the previous page.")
def list_envs(database_url: str, limit: int, cursor: str | None, **kw: Any) -> None:
    """List environments, newest first."""
    from rich.console import Console
    from rich.table import Table

    try:
        page = _store(database_url).list_environments(_filter(kw), limit, cursor)
    except MemoryServiceError as exc:
        raise click.ClickException(str(exc)) from None
    header = ("id", "class", "setting", "skill", "status", "ver", "plays", "win rate", "regret", "learnable")
    rows = [
        (
            e.id,
            e.env_class,
            e.setting,
            e.skill,
            e.status.value,
            str(e.weight_version),
            str(e.stats.plays),
            _fmt(e.stats.win_rate),
            _fmt(e.stats.regret),
            "yes" if e.stats.learnable else "",
        )
        for e in page.items
    ]
    more = f"more: --cursor {page.next_cursor}" if page.next_cursor else None
    if not sys.stdout.isatty():  # pipes and scripts get tab-separated lines
        for row in (header, *rows):
            click.echo("\t".join(row))
        if more:
            click.echo(more, err=True)
        return
    table = Table(*header)
    for row in rows:
        table.add_row(*row)
    console = Console()
    console.print(table)
    if more:
        console.print(more)


@envs.command("show")
@database_option
@click.argument("env_id")
@click.option("--code-only", is_flag=True, help="Print only the code (pipe it to a file).")
def show(database_url: str, env_id: str, code_only: bool) -> None:
    """Show one environment: statistics, hint, validation checks, code and recent plays."""
    from rich.console import Console
    from rich.markup import escape
    from rich.syntax import Syntax

    store = _store(database_url)
    try:
        e = store.get_environment(env_id)
        plays, _ = store.plays(env_id, 20)
    except MemoryServiceError as exc:
        raise click.ClickException(str(exc)) from None
    if code_only:
        click.echo(e.code, nl=not e.code.endswith("\n"))
        return
    c = Console()
    s = e.stats
    c.print(
        f"[bold]{e.env_class or e.id}[/] {e.id} — {e.setting} / {e.skill} — "
        f"{e.status.value}, version {e.weight_version}"
    )
    window = (
        "not fixed yet"
        if e.window_start is None
        else f"versions {e.window_start}..{e.window_start + e.window_versions - 1} ({e.window_versions} slots)"
    )
    c.print(f"window {window}")
    c.print(
        f"plays {s.plays}, win rate (mean return) {_fmt(s.win_rate)} over {s.window_plays}, solved "
        f"{_fmt(s.solved_fraction)}, regret {_fmt(s.regret)}"
        + (f" ({escape(s.regret_note)})" if s.regret_note else "")
        + f", learnable {'yes' if s.learnable else 'no'} {s.reward_components or ''}"
    )
    c.print(f"[bold]hint[/]: {escape(e.hint) or '(none)'}")
    for check in e.validation_report.get("checks", []):
        mark = "[green]pass[/]" if check.get("passed") else "[red]FAIL[/]"
        c.print(f"  {mark} {check.get('name')} {check.get('detail', '')}")
    c.print(Syntax(e.code, "python", line_numbers=True))
    for p in plays:
        c.print(
            f"  v{p.weight_version} slot {p.window_index} seed {p.seed} {'hinted ' if p.hinted else 'unhinted'} "
            f"return {p.episode_return:.2f} turns {p.turns} {p.finish_reason or ''}"
        )


@envs.command("export")
@database_option
@filter_options
@click.option("-o", "--output", type=click.Path(dir_okay=False, writable=True), help="File (default: stdout).")
def export(database_url: str, output: str | None, **kw: Any) -> None:
    """Write matching environments (code, hint, report, stats) as JSON Lines."""
    from services.memory.rest import detail

    store = _store(database_url)
    out = Path(output).open("w") if output else sys.stdout  # noqa: SIM115 - closed below
    n = 0
    try:
        for e in store.iter_environments(_filter(kw)):
            out.write(detail(e).model_dump_json() + "\n")
            n += 1
    finally:
        if output:
            out.close()
    if output:
        click.echo(f"wrote {n} environments to {output}", err=True)


@envs.command("hash-token")
@click.option("--token", help="The token to hash (prompted, hidden, when omitted).")
@click.option("--generate", is_flag=True, help="Generate a new random token and print it with its hash.")
@click.option("--tenant", help="With --generate: also print the SPADE_MEMORY_API_KEYS entry for this tenant.")
@click.option(
    "--role",
    type=click.Choice(["read", "write", "admin"]),
    default="write",
    show_default=True,
    help="The entry's role: read (the web page, REST), write (a service that stores), admin (sets the run spec).",
)
def hash_token_cmd(token: str | None, generate: bool, tenant: str | None, role: str) -> None:
    """Print the SHA-256 of an API key, for ``key_sha256`` in SPADE_MEMORY_API_KEYS or SPADE_SANDBOX_API_KEYS."""
    import json

    from spade.auth import generate_key, hash_key

    if generate:
        token, _ = generate_key()
        click.echo(f"token:  {token}")
    elif token is None:
        token = click.prompt("token", hide_input=True)
    click.echo(f"sha256: {hash_key(token or '')}" if generate else hash_key(token or ""))
    if generate and tenant:
        click.echo("entry:  " + json.dumps({"tenant": tenant, "key_sha256": hash_key(token or ""), "role": role}))


@envs.command("seed")
@click.option("--setting", type=click.Choice(SETTINGS), default=Setting.GAME.value, show_default=True)
@click.option("--memory", "memory_target", default="127.0.0.1:50052", show_default=True, help="Memory gRPC host:port.")
@click.option(
    "--memory-key",
    envvar="SPADE_MEMORY_API_KEY",
    default=None,
    help="Bearer key for --memory [env SPADE_MEMORY_API_KEY].",
)
@click.option(
    "--queue",
    "queue_json",
    default='{"kind": "redis", "url": "redis://127.0.0.1:6379/0"}',
    show_default=True,
    help="Queue configuration (JSON, as SPADE_ROLLOUT_QUEUE).",
)
@click.option(
    "--window", type=click.IntRange(0, 100_000), default=0, help="Versions the envs stay active (0: rollout's k)."
)
@click.option("--sandbox", "sandbox_target", default=None, help="Sandbox gRPC host:port: validate each example first.")
@click.option("--sandbox-key", envvar="SPADE_SANDBOX_API_KEY", default=None, help="Bearer key for --sandbox.")
@click.option("--example", "names", multiple=True, help="Only this example env (repeatable; default: all).")
def seed(
    setting: str,
    memory_target: str,
    memory_key: str | None,
    queue_json: str,
    window: int,
    sandbox_target: str | None,
    sandbox_key: str | None,
    names: tuple[str, ...],
) -> None:
    """Load the seed pool: store the example envs in the memory and announce them on envs.ready.

    Idempotent: seeding twice stores and announces nothing new.
    """
    from spade.queues.config import QueueConfigAdapter

    try:
        queue_config = QueueConfigAdapter.validate_json(queue_json)
    except ValidationError as exc:
        raise click.UsageError(f"--queue is not a valid queue configuration: {exc}") from None
    from services.memory.seed_pool import SeedPoolError
    from spade.auth import Forbidden, Unauthenticated
    from spade.sandbox import SandboxFault, SandboxRefused

    new: list[str] = []
    try:
        ids = asyncio.run(
            _seed(setting, memory_target, memory_key, queue_config, window, sandbox_target, sandbox_key, names, new)
        )
    except (SeedPoolError, SandboxFault, SandboxRefused, MemoryServiceError, Unauthenticated, Forbidden) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(seed_summary(setting, ids, new))
    for env_id in ids:
        click.echo(env_id)


def seed_summary(setting: str, ids: list[str], new: list[str]) -> str:
    """The first line ``spade envs seed`` prints: what this call stored, and what was there already.

    >>> seed_summary("game", ["a"], ["a"])
    'seed pool: 1 game environment stored and announced on envs.ready'
    >>> seed_summary("game", ["a", "b"], [])
    'seed pool: 2 game environments already stored and announced; nothing new'
    """

    def envs(n: int) -> str:
        return f"{n} {setting} environment{'' if n == 1 else 's'}"

    old = len(ids) - len(new)
    if not old:
        return f"seed pool: {envs(len(new))} stored and announced on envs.ready"
    if not new:
        return f"seed pool: {envs(old)} already stored and announced; nothing new"
    return f"seed pool: {envs(len(new))} stored and announced on envs.ready, {old} already stored"


async def _seed(
    setting: str,
    memory_target: str,
    memory_key: str | None,
    queue_config: Any,
    window: int,
    sandbox_target: str | None,
    key: str | None,
    names: tuple[str, ...],
    new: list[str],
) -> list[str]:
    from services.memory.seed_pool import seed_pool
    from spade.memory.client import MemoryClient
    from spade.queues.factory import make_queue
    from spade.sandbox.client import SandboxClient

    memory = MemoryClient(memory_target, api_key=memory_key)
    queue = make_queue(queue_config)
    sandbox = SandboxClient(sandbox_target, key) if sandbox_target else None
    try:
        validate = sandbox.validate if sandbox is not None else None
        return await seed_pool(setting, memory, queue, window_versions=window, validate=validate, names=names, new=new)
    finally:
        await memory.close()
        await queue.close()
        if sandbox is not None:
            await sandbox.close()


# -- spade runspec ----------------------------------------------------------------------------------

memory_target_option = click.option(
    "--memory",
    "memory_target",
    envvar="SPADE_MEMORY_TARGET",
    default="127.0.0.1:50052",
    show_default=True,
    help="The memory's gRPC host:port [env SPADE_MEMORY_TARGET].",
)
memory_key_option = click.option(
    "--memory-key",
    envvar="SPADE_MEMORY_API_KEY",
    default=None,
    help="Bearer key for the memory [env SPADE_MEMORY_API_KEY].",
)


@click.group()
def runspec() -> None:
    """Store or show the run spec: the settings every service of a run must agree on.

    Every service reads it from the memory at start and refuses to start when its own configuration
    contradicts it, naming the field (spade/runspec.py lists the fields).
    """


async def _with_client(target: str, key: str | None, call: Any) -> Any:
    from spade.memory.client import MemoryClient

    client = MemoryClient(target, timeout_s=30.0, api_key=key)
    try:
        return await call(client)
    finally:
        await client.close()


def _run_memory_call(target: str, key: str | None, call: Any) -> Any:
    from spade.auth import Forbidden, Unauthenticated

    try:
        return asyncio.run(_with_client(target, key, call))
    except (MemoryServiceError, Unauthenticated, Forbidden) as exc:
        raise click.ClickException(str(exc)) from None


@runspec.command("set")
@click.argument("spec_file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--replace", is_flag=True, help="Replace a different stored spec (then restart every service).")
@memory_target_option
@memory_key_option
def runspec_set(spec_file: Path, replace: bool, memory_target: str, memory_key: str | None) -> None:
    """Store SPEC_FILE (YAML or JSON of RunSpec fields; missing fields take the paper's defaults).

    Storing the same spec again changes nothing; a different one is refused (each differing field
    named) unless --replace.
    """
    from spade.config import ConfigError
    from spade.memory.runspec import load_spec_file

    try:
        spec = load_spec_file(spec_file)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    record = _run_memory_call(memory_target, memory_key, lambda c: c.set_run_spec(spec, replace=replace))
    click.echo(f"run spec {record.spec_id} stored in the memory at {memory_target}")


@runspec.command("show")
@memory_target_option
@memory_key_option
def runspec_show(memory_target: str, memory_key: str | None) -> None:
    """Print the stored run spec (JSON) after a line with its id."""
    record = _run_memory_call(memory_target, memory_key, lambda c: c.get_run_spec())
    click.echo(f"# run spec {record.spec_id}, stored {record.set_at.isoformat()}")
    click.echo(record.spec_json)
