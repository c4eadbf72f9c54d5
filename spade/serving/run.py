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
    """Run ``main(stop)`` in a new event loop; the first SIGTERM/SIGINT sets ``stop``."""

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        signals = (signal.SIGTERM, signal.SIGINT)

        def first_signal() -> None:
            stop.set()
            for sig in signals:  # a second signal gets the default behaviour: the process ends at once
                with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                    loop.remove_signal_handler(sig)

        for sig in signals:
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, first_signal)
        try:
            await main(stop)
        finally:
            for sig in signals:
                with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                    loop.remove_signal_handler(sig)

    asyncio.run(runner())
