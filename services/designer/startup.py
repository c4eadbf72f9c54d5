"""What the designer waits for at start, loudly and interruptibly: the run spec and its dependencies.

A service started before its peers waits for them; here every wait logs what it waits for and for
how long (every ``wait_log_s``), and a stop request (SIGTERM) ends it at once with
:class:`StopRequested` instead of being ignored until a 300 s timeout (issue 15).

The run spec comes from the memory the way every service reads it
(``spade.memory.runspec.fetch_run_spec``): the stored one, waiting until one is set; the designer's
own spec file is stored when none is, and refused when the stored spec differs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import TypeVar

from spade.memory.runspec import RunSpecStore, fetch_run_spec
from spade.runspec import RunSpec

log = logging.getLogger("spade.designer")

T = TypeVar("T")


class StopRequested(Exception):
    """A stop request (SIGTERM) arrived while the designer was still starting."""


async def logged_wait(what: str, work: Awaitable[T], *, stop: asyncio.Event | None, every_s: float) -> T:
    """Await ``work``, logging ``waiting for <what> (N s)`` every ``every_s``; a stop ends the wait.

    Raises:
        StopRequested: ``stop`` was set first (``work`` is cancelled).
    """
    task = asyncio.ensure_future(work)
    stopper = asyncio.ensure_future(stop.wait()) if stop is not None else None
    started = time.monotonic()
    try:
        while True:
            waiting = {task} | ({stopper} if stopper is not None else set())
            done, _ = await asyncio.wait(waiting, timeout=every_s, return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                return task.result()
            if stopper is not None and stopper in done:
                raise StopRequested(f"stopped while waiting for {what}")
            log.info("waiting for %s (%.0f s so far)", what, time.monotonic() - started)
    finally:
        if stopper is not None:
            stopper.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def run_spec_from_memory(
    memory: RunSpecStore, *, given: RunSpec | None, stop: asyncio.Event | None, every_s: float
) -> RunSpec:
    """The run's spec from the memory (``spade.memory.runspec.fetch_run_spec``), waiting loudly.

    Raises:
        RunSpecConflict: ``given`` (the designer's spec file) differs from the stored spec.
        StopRequested: ``stop`` was set while waiting for one to be stored.
    """
    return await logged_wait(
        "a run spec in the memory (store one with `spade runspec set FILE`)",
        fetch_run_spec(memory, given=given, service="designer", poll_s=min(1.0, every_s), log_every_s=float("inf")),
        stop=stop,
        every_s=every_s,
    )
