"""The embedded step loop's overlaps: a step's plays run beside its designer round (each new env played
once announced, a failure on either side ending both), a learner step left training must never
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


def _loop(tmp_path: Path, designer: Any, learner: _Learner, worker: Any = None) -> StepLoop:
    engine = SimpleNamespace(work=EngineWork())  # the server's work counters, all zero
    return StepLoop(
        settings=RunSettings(run_dir=tmp_path, steps=3),
        spec=None,  # type: ignore[arg-type]
        parts=SimpleNamespace(server=SimpleNamespace(engine=engine)),  # type: ignore[arg-type]
        designer=designer,  # type: ignore[arg-type]
        learner=learner,  # type: ignore[arg-type]
        worker=worker or _Worker(),
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


class _Rollout(_Worker):
    """A rollout with one pool env due and the envs a designer announces: ``step_envs`` registers what
    was announced (after a short block, as a queue read), ``play_due`` plays what is due."""

    def __init__(self, play_s: float = 0.05, fail: bool = False) -> None:
        super().__init__()
        self.announced: list[str] = []
        self.due = ["pool-env"]
        self.played: list[str] = []
        self.playing = asyncio.Event()
        self.reading = asyncio.Event()
        self.play_s, self.fail = play_s, fail
        self.cancelled = False

    async def step_envs(self) -> int:
        taken, self.announced = self.announced, []
        self.due += taken
        self.reading.set()
        await asyncio.sleep(0.01)  # the read's reply on its way: what is announced meanwhile comes next read
        self.reading.clear()
        return len(taken)

    async def play_due(self, skip: Any = ()) -> int:
        due, self.due = self.due, []
        if due:
            self.playing.set()
        try:
            await asyncio.sleep(self.play_s if due else 0)
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        if self.fail:
            raise RuntimeError("the sandbox went away")
        self.played += due
        return len(due)


class _AnnouncingDesigner:
    """A round that waits (up to 5 s) for plays to run beside it (and fails there, if told to) and for
    a queue read in flight, then announces one env and ends at once: the read misses it and the round
    has ended when it returns, the order in which a loop that checks the round's end after the read
    would lose the env."""

    def __init__(self, rollout: _Rollout, fail: bool = False) -> None:
        self.rollout, self.fail = rollout, fail
        self.saw_plays = False
        self.cancelled = False

    async def run_batch(self, *, round_index: int, weight_version: int) -> None:
        try:
            await asyncio.wait_for(self.rollout.playing.wait(), 5)
            self.saw_plays = True
            if self.fail:
                raise RuntimeError("the designer broke")
            await asyncio.wait_for(self.rollout.reading.wait(), 5)
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        self.rollout.announced.append("new-env")


async def test_the_pool_plays_beside_the_designer_round_and_its_new_env_is_played_once_announced(
    tmp_path: Path,
) -> None:
    rollout = _Rollout()
    designer = _AnnouncingDesigner(rollout)
    loop = _loop(tmp_path, designer, _Learner(), rollout)
    generated = await asyncio.wait_for(loop.generate(1), 10)
    assert designer.saw_plays  # the round had plays beside it (sequential, it would have waited 5 s and failed)
    assert rollout.played == ["pool-env", "new-env"]  # announced as the round ended, during a read: played
    phases = generated.phases
    assert 0 < phases["rollout_beside_designer"] <= phases["designer"] < 5
    assert phases["rollout"] >= rollout.play_s  # the new env's plays came after the round


async def test_a_designer_round_that_fails_beside_the_plays_cancels_them_and_fails_the_step(tmp_path: Path) -> None:
    rollout = _Rollout(play_s=30.0)
    designer = _AnnouncingDesigner(rollout, fail=True)
    loop = _loop(tmp_path, designer, _Learner(), rollout)
    with pytest.raises(RuntimeError, match="the designer broke"):
        await asyncio.wait_for(loop.generate(1), 10)  # not after the 30 s of plays
    assert rollout.cancelled and rollout.played == []


async def test_plays_that_fail_beside_the_designer_round_cancel_the_round_and_fail_the_step(tmp_path: Path) -> None:
    rollout = _Rollout(fail=True)
    rollout.playing.wait = asyncio.Event().wait  # type: ignore[method-assign]  # the round never ends by itself
    designer = _AnnouncingDesigner(rollout)
    loop = _loop(tmp_path, designer, _Learner(), rollout)
    with pytest.raises(RuntimeError, match="the sandbox went away"):
        await asyncio.wait_for(loop.generate(1), 10)
    assert designer.cancelled and not designer.saw_plays
