"""Where a step's time goes: busy time and generated tokens per component of the embedded loop.

The runner hands each service a :class:`Timed` stand-in for the parts it calls (the inference
client, the sandbox sessions, the memory), so ``time/<component>_busy_s`` and
``work/<component>_calls`` in ``metrics.jsonl`` come from the calls themselves.
"""

from __future__ import annotations

import inspect
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from services.memory.service import MemoryService
from spade.memory.records import Environment, Play, RecordResult, StatsUpdate


class PhaseClock:
    """Busy time and generated tokens per component of the loop, for ``time/...`` in ``metrics.jsonl``.

    Components are timed where the runner hands them to the services (:class:`Timed`); calls that
    overlap (concurrent plays) add up, so a component's busy time can exceed the step's wall time.
    """

    def __init__(self) -> None:
        self.busy: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.tokens: dict[str, int] = defaultdict(int)

    def add(self, component: str, seconds: float, tokens: int = 0) -> None:
        self.busy[component] += seconds
        self.calls[component] += 1
        self.tokens[component] += tokens

    def take(self) -> tuple[dict[str, float], dict[str, int]]:
        """This step's figures, then reset: seconds busy per component (``<component>_busy``) and
        counts (``<component>_calls``, ``<component>_tokens`` generated)."""
        seconds = {f"{name}_busy": busy for name, busy in self.busy.items()}
        counts = {f"{name}_calls": self.calls[name] for name in self.busy}
        counts.update({f"{name}_tokens": tokens for name, tokens in self.tokens.items() if tokens})
        self.busy.clear()
        self.calls.clear()
        self.tokens.clear()
        return seconds, counts


def _generated_tokens(result: Any) -> int:
    if isinstance(result, list | tuple):
        return sum(_generated_tokens(r) for r in result)
    ids = getattr(result, "output_ids", None)
    return len(ids) if isinstance(ids, list | tuple) else 0


class Timed:
    """A stand-in for ``target`` that times each of its coroutine methods under ``component``.

    ``wrap_results`` times the objects those methods return too (a sandbox session's ``step``).
    """

    def __init__(self, target: Any, clock: PhaseClock, component: str, *, wrap_results: bool = False) -> None:
        self._target = target
        self._clock = clock
        self._component = component
        self._wrap = wrap_results

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._target, name)
        if not inspect.iscoroutinefunction(attr):
            return attr

        async def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                result = await attr(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
            self._clock.add(self._component, elapsed, _generated_tokens(result))
            return Timed(result, self._clock, self._component) if self._wrap else result

        return timed


class TappedMemory:
    """The memory as the rollout uses it, keeping a copy of every play recorded in this step."""

    def __init__(self, memory: MemoryService, clock: PhaseClock | None = None) -> None:
        self.memory = memory
        self.plays: list[Play] = []
        self._clock = clock

    def _took(self, start: float) -> None:
        if self._clock is not None:
            self._clock.add("rollout_memory", time.perf_counter() - start)

    async def get_environment(self, env_id: str) -> Environment:
        start = time.perf_counter()
        try:
            return await self.memory.get_environment(env_id)
        finally:
            self._took(start)

    async def record_plays(self, plays: Sequence[Play]) -> RecordResult:
        self.plays.extend(plays)
        start = time.perf_counter()
        try:
            return await self.memory.record_plays(plays)
        finally:
            self._took(start)

    async def set_window(self, env_id: str, window_start: int, window_versions: int) -> Environment:
        start = time.perf_counter()
        try:
            return await self.memory.set_window(env_id, window_start, window_versions)
        finally:
            self._took(start)

    async def update_stats(self, env_id: str, update: StatsUpdate) -> Environment:
        start = time.perf_counter()
        try:
            return await self.memory.update_stats(env_id, update)
        finally:
            self._took(start)
