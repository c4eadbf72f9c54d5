"""The one start-up wait (spade.serving.startup): it logs while it waits, and a stop ends it."""

from __future__ import annotations

import asyncio
import logging

import pytest

from spade.serving.startup import StoppedWhileWaiting, logged_wait


async def test_logged_wait_logs_while_it_waits_and_a_stop_cancels_the_work(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    assert await logged_wait("a quick thing", asyncio.sleep(0, result=5), stop=None, every_s=1, service="designer") == 5

    stop = asyncio.Event()
    never = asyncio.Event()
    work = asyncio.ensure_future(never.wait())
    waiting = asyncio.create_task(
        logged_wait("the inference servers", work, stop=stop, every_s=0.05, service="designer")
    )
    while "designer waiting for the inference servers" not in caplog.text:
        await asyncio.sleep(0.01)
    stop.set()
    with pytest.raises(StoppedWhileWaiting, match="inference servers"):
        await waiting
    assert work.cancelled()
