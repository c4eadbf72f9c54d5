"""How every ``spade serve X`` starts and stops: settings or a readable refusal, then run until a signal.

- :func:`settings_or_exit` builds a service's settings (``--config`` file, environment, flags); on a
  bad value it prints one line per problem, naming the environment variable, and exits with status 2
  (no traceback).
- :func:`run_until_signalled` runs a service's main coroutine with a stop event that the first
  SIGTERM or SIGINT sets, so the service shuts down gracefully (in-flight work finishes, servers
  drain); a second signal gets the default behaviour (the process ends at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import click
from pydantic import ValidationError

from spade.config import ConfigError, ServiceSettings, describe_error

S = TypeVar("S", bound=ServiceSettings)

config_option = click.option(
    "--config",
    "config_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="YAML/JSON settings file (its values win over SPADE_<SERVICE>_* variables; flags win over both).",
)
"""The ``--config FILE`` option every ``spade serve`` command takes."""


log_level_option = click.option(
    "--log-level", default=None, help="Logging level (DEBUG, INFO, ...; default: SPADE_LOG_LEVEL, else INFO)."
)
"""``--log-level`` of a ``spade serve`` command; pass its value to :func:`configure_logs`."""


def configure_logs(service: str, log_level: str | None) -> None:
    """Log as ``SPADE_LOG_FORMAT`` says, at ``--log-level`` (else ``SPADE_LOG_LEVEL``), for ``service``.

    Raises:
        click.UsageError: An unknown level or format.
    """
    from spade.serving.logs import configure_from_env

    try:
        configure_from_env(service, level=log_level)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None


def settings_or_exit(cls: type[S], config_file: Path | None = None, **overrides: Any) -> S:
    """``cls.load(config_file, **overrides)``, or a readable refusal and exit status 2.

    Overrides that are ``None`` (flags not given) are ignored.
    """
    try:
        return cls.load(config_file, **overrides)
    except (ValidationError, ConfigError) as exc:
        click.echo(f"invalid {cls.service_name} settings:", err=True)
        click.echo(describe_error(exc, cls), err=True)
        raise SystemExit(2) from None


def run_until_signalled(main: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Run ``main(stop)`` in a new event loop; the first SIGTERM/SIGINT sets ``stop``.

    The service's ``stopping`` line (naming the signal) is logged when the signal arrives, and its
    ``stopped`` line (the signal, what ``main`` noted as finished, how long the stop took) once
    ``main`` returns (:mod:`spade.serving.lifecycle`).
    """
    from spade.serving import lifecycle

    lifecycle.begin()
    received: list[tuple[str, float]] = []

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        signals = (signal.SIGTERM, signal.SIGINT)

        def first_signal(which: signal.Signals) -> None:
            received.append((which.name, time.monotonic()))
            lifecycle.stopping(which.name)
            stop.set()
            for sig in signals:  # a second signal gets the default behaviour: the process ends at once
                with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                    loop.remove_signal_handler(sig)

        for sig in signals:
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, first_signal, sig)
        try:
            await main(stop)
        finally:
            for sig in signals:
                with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                    loop.remove_signal_handler(sig)

    asyncio.run(runner())
    name, at = received[0] if received else (None, None)
    lifecycle.stopped(name, None if at is None else time.monotonic() - at)
