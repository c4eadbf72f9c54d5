"""What the designer waits for at start, loudly and interruptibly: the run spec and its dependencies.

A service started before its peers waits for them; here every wait logs what it waits for and for
how long (every ``wait_log_s``), and a stop request (SIGTERM) ends it at once with
:class:`spade.serving.startup.StoppedWhileWaiting` instead of being ignored until a 300 s timeout (issue 15).

The run spec comes from the memory the way every service reads it
(``spade.memory.runspec.fetch_run_spec``): the stored one, waiting until one is set; the designer's
own spec file is stored when none is, and refused when the stored spec differs.
"""

from __future__ import annotations

import asyncio
from typing import TypeVar

from spade.memory.runspec import RunSpecStore, fetch_run_spec
from spade.runspec import RunSpec
from spade.serving.logs import get_logger
from spade.serving.startup import logged_wait

log = get_logger(__name__)

T = TypeVar("T")


async def run_spec_from_memory(
    memory: RunSpecStore, *, given: RunSpec | None, stop: asyncio.Event | None, every_s: float
) -> RunSpec:
    """The run's spec from the memory (``spade.memory.runspec.fetch_run_spec``), waiting loudly.

    Raises:
        RunSpecConflict: ``given`` (the designer's spec file) differs from the stored spec.
        StoppedWhileWaiting: ``stop`` was set while waiting for one to be stored.
    """
    return await logged_wait(
        "a run spec in the memory (store one with `spade runspec set FILE`)",
        fetch_run_spec(memory, given=given, service="designer", poll_s=min(1.0, every_s), log_every_s=float("inf")),
        stop=stop,
        every_s=every_s,
        service="designer",
        logger=log,
    )
