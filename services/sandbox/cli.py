"""``spade serve sandbox`` and ``spade sandbox exec|validate``."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import click

from spade.envs.types import SETTINGS, Setting
from spade.serving.run import config_option, configure_logs, log_level_option


def _settings(config: Path | None, **overrides: Any) -> Any:
    from services.sandbox.settings import SandboxSettings
    from spade.serving.run import settings_or_exit

    return settings_or_exit(SandboxSettings, config, **overrides)


@click.command("sandbox")
@config_option
@click.option("--host", default=None, help="Interface both servers bind (default 127.0.0.1).")
@click.option("--grpc-port", type=int, default=None, help="gRPC port (default 50051).")
@click.option("--http-port", type=int, default=None, help="REST port (default 8081).")
@click.option("--dev", "dev_mode", is_flag=True, default=None, help="Dev mode: anonymous access allowed.")
@log_level_option
def serve(
    config_file: Path | None,
    host: str | None,
    grpc_port: int | None,
    http_port: int | None,
    dev_mode: bool | None,
    log_level: str | None,
) -> None:
    """Serve the sandbox over gRPC and REST until SIGTERM/SIGINT (then drain and stop)."""
    configure_logs("sandbox", log_level)
    from services.sandbox.isolation import SandboxUnavailable
    from services.sandbox.isolation.cgroups import CgroupUnavailable
    from services.sandbox.wiring import serve_forever
    from spade.serving.run import run_until_signalled

    grpc_bind = {k: v for k, v in {"host": host, "port": grpc_port}.items() if v is not None}
    http_bind = {k: v for k, v in {"host": host, "port": http_port}.items() if v is not None}
    settings = _settings(config_file, grpc=grpc_bind or None, http=http_bind or None, dev_mode=dev_mode)
    try:
        run_until_signalled(lambda stop: serve_forever(settings, stop))
    except (SandboxUnavailable, CgroupUnavailable, OSError) as exc:
        raise click.ClickException(str(exc)) from exc


@click.group("sandbox")
def sandbox() -> None:
    """Run or validate code in the sandbox, locally (no server needed)."""


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise click.UsageError(f"{path} is not UTF-8 text: save it as UTF-8") from exc


async def _with_pool(settings: Any, fn: Any) -> Any:
    from services.sandbox.isolation import SandboxPool

    pool = SandboxPool(settings.isolation)
    await pool.start()
    try:
        return await fn(pool)
    finally:
        await pool.stop()


@sandbox.command("exec")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "--stdin", "stdin_file", type=click.Path(exists=True, dir_okay=False, path_type=Path), help="File fed to stdin."
)
@click.option(
    "--timeout", "timeout_s", type=click.FloatRange(min=0.01), default=None, help="Wall-clock limit, seconds."
)
@click.option("--memory-mb", type=click.IntRange(min=16), default=None, help="Address-space limit, MiB.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--config", type=click.Path(exists=True, dir_okay=False, path_type=Path), help="YAML/JSON settings file.")
def exec_command(
    file: Path,
    stdin_file: Path | None,
    timeout_s: float | None,
    memory_mb: int | None,
    as_json: bool,
    config: Path | None,
) -> None:
    """Run a Python program in the sandbox and report how it ended (exit 0 whatever it did)."""
    from services.sandbox.core.errors import SandboxServiceError
    from services.sandbox.core.requests import check_code, check_execution

    settings = _settings(config, dev_mode=True)
    code = _read_text(file)
    stdin = stdin_file.read_bytes() if stdin_file else b""
    limits = settings.request_limits()
    try:
        check_code(code, limits)
        check_execution(stdin, {}, timeout_s or 0.0, memory_mb or 0, limits)
    except SandboxServiceError as exc:
        raise click.UsageError(str(exc)) from exc

    async def run(pool: Any) -> Any:
        return await pool.execute(code, stdin, {}, timeout_s=timeout_s, memory_mb=memory_mb)

    result = asyncio.run(_with_pool(settings, run))
    payload = {
        "status": str(getattr(result.status, "value", result.status)),
        "exit_code": result.exit_code,
        "stdout": result.stdout.decode("utf-8", errors="replace"),
        "stderr": result.stderr.decode("utf-8", errors="replace"),
        "duration_ms": round(result.duration_ms, 3),
    }
    if as_json:
        click.echo(json.dumps(payload))
        return
    sys.stdout.write(payload["stdout"])
    sys.stderr.write(payload["stderr"])
    click.echo(f"[{payload['status']}] exit code {payload['exit_code']} in {payload['duration_ms']:.1f} ms", err=True)


@sandbox.command("validate")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--setting", type=click.Choice(SETTINGS), default=Setting.GAME.value, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--config", type=click.Path(exists=True, dir_okay=False, path_type=Path), help="YAML/JSON settings file.")
def validate_command(file: Path, setting: str, as_json: bool, config: Path | None) -> None:
    """Run every validation check on one environment file (exit 0 whatever the verdict)."""
    from services.sandbox.core.errors import SandboxServiceError
    from services.sandbox.core.requests import check_code

    settings = _settings(config, dev_mode=True)
    code = _read_text(file)
    try:
        check_code(code, settings.request_limits())
    except SandboxServiceError as exc:
        raise click.UsageError(str(exc)) from exc

    async def run(pool: Any) -> Any:
        return await pool.validate(code, setting, settings.checks)

    report = asyncio.run(_with_pool(settings, run))
    payload = {
        "valid": report.valid,
        "setting": str(getattr(report.setting, "value", report.setting)),
        "env_class": report.env_class,
        "checks": [{"name": c.name, "passed": c.passed, "detail": c.detail} for c in report.checks],
    }
    if as_json:
        click.echo(json.dumps(payload))
        return
    for check in payload["checks"]:
        mark = "PASS" if check["passed"] else "FAIL"
        click.echo(f"{mark:4} {check['name']:18} {check['detail']}")
    click.echo(f"{'VALID' if report.valid else 'INVALID'}: {payload['env_class'] or '(no env class)'}")


@sandbox.command("keygen")
@click.option("--tenant", default="my-team", show_default=True, help="Tenant name for the configuration entry.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def keygen_command(tenant: str, as_json: bool) -> None:
    """Make a new API key; print it (give it to the caller, once) and the entry that configures it.

    The sandbox keeps only the key's SHA-256: add the printed entry to SPADE_SANDBOX_API_KEYS (or the
    api_keys list of the settings file). The caller sends the key as 'Authorization: Bearer <key>'.
    """
    from services.sandbox.settings import SandboxApiKey
    from spade.auth import generate_key

    key, digest = generate_key()
    entry = SandboxApiKey(tenant=tenant, key_sha256=digest).model_dump()
    if as_json:
        click.echo(json.dumps({"key": key, "sha256": digest, "entry": entry}))
        return
    click.echo(f"key:    {key}")
    click.echo(f"sha256: {digest}")
    click.echo(f"entry:  {json.dumps(entry)}")
    click.echo(
        "Configure the entry (SPADE_SANDBOX_API_KEYS='[...]'); hand the key to the caller: it is stored nowhere.",
        err=True,
    )
