"""Starting loudly and interruptibly: the run spec from the real memory service, waits that log what
they wait for, and a stop request that ends any wait at once."""

from __future__ import annotations

import asyncio
import logging

import pytest

from services.designer.startup import run_spec_from_memory
from services.memory.service import MemoryService
from spade.memory.errors import RunSpecConflict
from spade.runspec import RunSpec
from spade.serving.startup import StoppedWhileWaiting


async def test_the_designer_waits_for_a_spec_saying_so_then_takes_the_stored_one(
    memory_service: MemoryService, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="spade.designer")
    spec = RunSpec(envs_per_round=8, skills_per_round=2)
    waiting = asyncio.create_task(run_spec_from_memory(memory_service, given=None, stop=None, every_s=0.05))
    while "waiting for a run spec" not in caplog.text:
        await asyncio.sleep(0.01)
    assert not waiting.done()
    await memory_service.set_run_spec(spec)
    assert (await waiting).spec_id == spec.spec_id
    assert "spade runspec set FILE" in caplog.text


async def test_a_spec_file_is_stored_when_none_is_and_must_equal_the_stored_one(memory_service: MemoryService) -> None:
    mine = RunSpec(envs_per_round=6, skills_per_round=3)
    assert (await run_spec_from_memory(memory_service, given=mine, stop=None, every_s=1)).spec_id == mine.spec_id
    assert RunSpec.from_json((await memory_service.get_run_spec()).spec_json) == mine
    # A second designer with the same file reads it; one with another file refuses, naming the field.
    assert (await run_spec_from_memory(memory_service, given=mine, stop=None, every_s=1)) == mine
    other = RunSpec(envs_per_round=12)
    with pytest.raises(RunSpecConflict, match="envs_per_round: stored 6, given 12"):
        await run_spec_from_memory(memory_service, given=other, stop=None, every_s=1)


async def test_a_stop_ends_the_wait_for_the_spec(memory_service: MemoryService) -> None:
    stop = asyncio.Event()
    waiting = asyncio.create_task(run_spec_from_memory(memory_service, given=None, stop=stop, every_s=1))
    await asyncio.sleep(0.1)
    stop.set()
    with pytest.raises(StoppedWhileWaiting, match="run spec"):
        await asyncio.wait_for(waiting, timeout=10)
