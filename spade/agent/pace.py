"""The pace of real plays, so that audit plays keep the same time between an env's calls.

An env can read a clock. A real play calls ``step()`` only after the model has generated its turn
(seconds on this machine's CPU, about a second on a GPU server); a trivial policy with no model would
call at once. An env that is honest while its calls come fast and lets any action win once they come
slowly (``tests/security/test_forging_envs.py``'s timing forger) would then pass its audit and give
every real play the win. So the rollout records the *gap* of each real turn — from the env's last
answer (its ``reset`` or previous ``step``) to the next ``step`` call — and each audit turn waits a gap
drawn from those records before it steps. Per turn, the env cannot tell an audit play from a real one
by when its calls come.

What still differs, stated plainly: draws are independent, so a correlation within one real play
(later turns with longer prompts generating more slowly) is not reproduced; and the first audit of a
worker that has recorded nothing yet waits for the first real gap (see :meth:`TurnPace.gap`).

>>> import asyncio, random
>>> pace = TurnPace(first_gap_wait_s=0.0)
>>> for gap in (2.0, 3.0, 4.0):
...     pace.record(gap)
>>> asyncio.run(pace.gap(random.Random(0))) in (2.0, 3.0, 4.0)
True
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import deque


class TurnPace:
    """The recent gaps of real turns, and draws from them for audit turns.

    Args:
        keep: Gaps kept (the most recent); older ones are forgotten, so the pace follows the load.
        first_gap_wait_s: Before any gap is recorded, how long a draw waits for the first one.
    """

    def __init__(self, keep: int = 512, first_gap_wait_s: float = 120.0) -> None:
        if keep < 1 or first_gap_wait_s < 0:
            raise ValueError(f"keep must be >= 1 and first_gap_wait_s >= 0, got {keep} and {first_gap_wait_s}")
        self._gaps: deque[float] = deque(maxlen=keep)
        self._first = asyncio.Event()
        self.first_gap_wait_s = first_gap_wait_s

    def __len__(self) -> int:
        return len(self._gaps)

    def record(self, gap_s: float) -> None:
        """One real turn's gap, in seconds (negative or not finite values are refused)."""
        if not 0.0 <= gap_s < float("inf"):
            raise ValueError(f"a turn's gap is a duration in seconds, got {gap_s!r}")
        self._gaps.append(gap_s)
        self._first.set()

    async def gap(self, rng: random.Random) -> float:
        """A gap for one audit turn: one of the recorded gaps, drawn with ``rng``.

        With nothing recorded yet (a new worker's first env, whose real plays start alongside its audit)
        it waits for the first real gap, at most ``first_gap_wait_s``, and returns the time it waited:
        it started with the real plays, so that wait was itself a real turn's gap. Without real turns
        in flight it waits the whole ``first_gap_wait_s``.
        """
        if not self._gaps:
            started = time.monotonic()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._first.wait(), timeout=self.first_gap_wait_s)
            return time.monotonic() - started
        return rng.choice(self._gaps)

    async def wait(self, rng: random.Random) -> float:
        """Sleep one audit turn's :meth:`gap` (counted from now) and return it."""
        started = time.monotonic()
        gap = await self.gap(rng)
        remaining = gap - (time.monotonic() - started)
        if remaining > 0:
            await asyncio.sleep(remaining)
        return gap
