"""The embedded step loop's overlap on its failure paths: a learner step left training must never
outlive a failed run, and a learner that fails before taking its batch fails the run at once.

The roles are stand-ins (no model): what is under test is how ``StepLoop.steps`` orders and ends them.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from services.embedded.instruments import PhaseClock
from services.embedded.pool_choice import PoolChoice
from services.embedded.runner import PublishGate, StepLoop
from services.embedded.settings import RunSettings
from services.inference.engine import EngineWork


class _Designer:
    def __init__(self, fail_at_round: int) -> None:
        self.rounds: list[int] = []
        self.fail_at_round = fail_at_round

    async def run_batch(self, *, round_index: int, weight_version: int) -> None:
        self.rounds.append(round_index)
        if round_index == self.fail_at_round:
            raise RuntimeError("the designer broke")


class _Learner:
    """A learner step that takes its batch, then trains until cancelled (or fails at once)."""

    def __init__(self, fail_before_assembling: bool = False) -> None:
        self.version = 0
        self.fail_before_assembling = fail_before_assembling
        self.training = asyncio.Event()
        self.cancelled = False

    async def run_step(self, stop: Any = None, on_assembled: Any = None) -> Any:
        if self.fail_before_assembling:
            raise ValueError("the learner could not read its queues")
        on_assembled()
        self.training.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise


class _Worker:
    def __init__(self) -> None:
        self.store = SimpleNamespace(due_envs=self._due)

    async def _due(self) -> set[str]:
        return set()

    async def step_weights(self) -> int:
        return 0

    async def step_envs(self) -> int:
        return 0

    async def play_due(self, skip: Any = ()) -> int:
        return 0


class _Publisher:
    async def publish(self, *args: Any, **kwargs: Any) -> None:
        return None


def _loop(tmp_path: Path, designer: _Designer, learner: _Learner) -> StepLoop:
    engine = SimpleNamespace(work=EngineWork())  # the server's work counters, all zero
    return StepLoop(
        settings=RunSettings(run_dir=tmp_path, steps=3),
        spec=None,  # type: ignore[arg-type]
        parts=SimpleNamespace(server=SimpleNamespace(engine=engine)),  # type: ignore[arg-type]
        designer=designer,  # type: ignore[arg-type]
        learner=learner,  # type: ignore[arg-type]
        worker=_Worker(),  # type: ignore[arg-type]
        tapped=SimpleNamespace(plays=[]),  # type: ignore[arg-type]
        clock=PhaseClock(),
        choice=PoolChoice([], per_step=1, retire_after=1),
        scored=[],
        gate=PublishGate(_Publisher()),
        progress=lambda phase, done, total: None,
        start=0.0,
    )


def _no_line(record: dict[str, Any], generated: Any) -> None:
    raise AssertionError(f"no step finished, yet a line was written: {record}")


async def test_a_generation_that_fails_while_a_step_trains_cancels_that_step_and_opens_the_gate(
    tmp_path: Path,
) -> None:
    designer, learner = _Designer(fail_at_round=1), _Learner()
    loop = _loop(tmp_path, designer, learner)
    with pytest.raises(RuntimeError, match="the designer broke"):
        await asyncio.wait_for(loop.steps(None, _no_line), 10)
    # Step 1 was training beside step 2's generation; the failure ended it, and nothing stays held.
    assert designer.rounds == [0, 1] and learner.training.is_set() and learner.cancelled
    assert loop.gate is not None and loop.gate.open.is_set()


async def test_a_learner_failing_before_it_takes_its_batch_fails_the_run_before_the_next_step(
    tmp_path: Path,
) -> None:
    designer, learner = _Designer(fail_at_round=99), _Learner(fail_before_assembling=True)
    loop = _loop(tmp_path, designer, learner)
    with pytest.raises(ValueError, match="could not read its queues"):
        await asyncio.wait_for(loop.steps(None, _no_line), 10)
    assert designer.rounds == [0]  # step 2 never generated on a learner that had already failed
