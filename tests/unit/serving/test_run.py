"""Starting and stopping a service: readable refusals (exit 2) and graceful shutdown on a signal."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from pydantic import Field
from pydantic_settings import SettingsConfigDict

from spade.config import ServiceSettings
from spade.serving.run import config_option, run_until_signalled, settings_or_exit


class DemoSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="SPADE_DEMO_")
    service_name = "demo"

    workers: int = Field(default=1, ge=1, le=8, description="Workers.")
    api_key: str | None = Field(default=None, description="Key.")

    def unsafe_settings(self) -> list[str]:
        return [] if self.api_key else [f"no key: set {self.env_name('api_key')}"]


@click.command()
@config_option
@click.option("--workers", type=int, default=None)
def demo(config_file: Path | None, workers: int | None) -> None:
    settings = settings_or_exit(DemoSettings, config_file, workers=workers)
    click.echo(f"workers={settings.workers}")


def test_bad_settings_print_one_line_per_problem_and_exit_2(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPADE_DEMO_WORKERS", "99")
    result = CliRunner().invoke(demo, [])
    assert result.exit_code == 2
    assert "SPADE_DEMO_WORKERS" in result.output and "Traceback" not in result.output
    monkeypatch.setenv("SPADE_DEMO_WORKERS", "3")
    result = CliRunner().invoke(demo, [])
    assert result.exit_code == 2 and "SPADE_DEMO_API_KEY" in result.output and "SPADE_DEMO_DEV_MODE" in result.output
    config = tmp_path / "demo.yaml"
    config.write_text("api_key: k\nworkers: 5\n")
    result = CliRunner().invoke(demo, ["--config", str(config), "--workers", "6"])
    assert result.exit_code == 0 and "workers=6" in result.output  # flags win over the file
    config.write_text("- not a mapping\n")
    result = CliRunner().invoke(demo, ["--config", str(config)])
    assert result.exit_code == 2 and "expected a mapping" in result.output


def test_the_first_signal_stops_gracefully() -> None:
    finished: list[str] = []

    async def service(stop: asyncio.Event) -> None:
        asyncio.get_running_loop().call_later(0.05, os.kill, os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(stop.wait(), timeout=30)
        await asyncio.sleep(0.01)  # in-flight work finishes after the signal
        finished.append("drained")

    run_until_signalled(service)
    assert finished == ["drained"]
    assert signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, signal.default_int_handler, None)


def test_the_stop_is_logged_naming_the_signal_and_what_the_service_finished() -> None:
    import io
    import json

    from spade.serving import lifecycle, logs

    out = io.StringIO()
    logs.configure("demo", stream=out)

    async def service(stop: asyncio.Event) -> None:
        lifecycle.started("demo serving on port 1", settings={"port": 1, "url": "redis://u:pw@h:6379/0"}, port=1)
        asyncio.get_running_loop().call_later(0.05, os.kill, os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(stop.wait(), timeout=30)
        lifecycle.note_finished("demo stopped after 2 jobs", jobs=2)

    try:
        run_until_signalled(service)
    finally:
        logs.reset()
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [(x["event"], x["level"]) for x in lines] == [("started", "info"), ("stopping", "info"), ("stopped", "info")]
    started, stopping, stopped = lines
    assert started["message"] == "demo serving on port 1" and started["port"] == 1 and "settings" not in started
    assert stopping["signal"] == "SIGTERM" and stopping["message"] == "SIGTERM received: stopping"
    assert stopped["signal"] == "SIGTERM" and stopped["finished"] == {"jobs": 2}
    assert stopped["message"] == "demo stopped after 2 jobs, on SIGTERM: jobs=2"


def test_a_stopped_line_reports_only_its_own_runs_figures() -> None:
    """What work outside a run noted (a rollout worker's slots, in a test or a notebook) must not
    appear in the next service's ``stopped`` line in the same process."""
    import io
    import json

    from spade.serving import lifecycle, logs

    lifecycle.note_finished("worker stopped", slots_handed_back=1)  # no run_until_signalled around it
    out = io.StringIO()
    logs.configure("demo", stream=out)

    async def service(stop: asyncio.Event) -> None:
        lifecycle.note_finished(sessions_closed=2)

    try:
        run_until_signalled(service)
    finally:
        logs.reset()
    (stopped,) = (json.loads(line) for line in out.getvalue().splitlines())
    assert stopped["finished"] == {"sessions_closed": 2}
    assert stopped["message"] == "stopped, by itself (no signal): sessions_closed=2"


def test_the_full_settings_are_logged_at_debug_only_with_passwords_masked() -> None:
    import io
    import json

    from spade.serving import lifecycle, logs

    out = io.StringIO()
    logs.configure("demo", stream=out, level="DEBUG")
    try:
        lifecycle.started("demo serving", settings={"url": "postgresql://spade:s3cret@db/spade"}, port=1)
    finally:
        logs.reset()
    started, dump = (json.loads(line) for line in out.getvalue().splitlines())
    assert started["event"] == "started" and dump["event"] == "settings" and dump["level"] == "debug"
    assert dump["settings"] == {"url": "postgresql://spade:***@db/spade"} and "s3cret" not in out.getvalue()
