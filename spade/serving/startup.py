"""Waiting at start-up, loudly and interruptibly: the one helper every service's start uses.

A service started before its peers waits for them (the run spec in the memory, a database, the
inference servers). Every such wait logs what it waits for and for how long, and a stop request
(SIGTERM, the ``stop`` event) ends it at once with :class:`StoppedWhileWaiting` instead of being
ignored until some timeout.

>>> import asyncio
>>> asyncio.run(logged_wait("a quick thing", asyncio.sleep(0, result=5), stop=None, every_s=1, service="demo"))
5
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import TypeVar

from spade.serving.logs import get_logger, log_event

T = TypeVar("T")

log = get_logger(__name__)


class StoppedWhileWaiting(Exception):
    """A stop request (SIGTERM) arrived while a service was still waiting at start-up."""


async def logged_wait(
    what: str,
    work: Awaitable[T],
    *,
    stop: asyncio.Event | None,
    every_s: float,
    service: str,
    logger: logging.Logger | None = None,
) -> T:
    """Await ``work``; every ``every_s`` log ``<service> waiting for <what>: N s so far``; a stop ends it.

    The log line is a warning with the structured fields ``event=waiting``, ``for`` and ``waited_s``.

    Raises:
        StoppedWhileWaiting: ``stop`` was set first (``work`` is cancelled).
    """
    logger = logger or log
    task = asyncio.ensure_future(work)
    stopper = asyncio.ensure_future(stop.wait()) if stop is not None else None
    started = time.monotonic()
    try:
        while True:
            pending = {task} | ({stopper} if stopper is not None else set())
            done, _ = await asyncio.wait(pending, timeout=every_s, return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                return task.result()
            if stopper is not None and stopper in done:
                raise StoppedWhileWaiting(f"stopped while waiting for {what}")
            waited = time.monotonic() - started
            log_event(
                logger,
                "waiting",
                f"{service} waiting for {what}: {waited:.0f} s so far",
                level=logging.WARNING,
                **{"for": what, "waited_s": round(waited)},
            )
    finally:
        if stopper is not None:
            stopper.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
