"""The pace of real plays, so that audit plays keep the same time between an env's calls.

An env can read a clock. A real play calls ``step()`` only after the model has generated its turn
(seconds on this machine's CPU, about a second on a GPU server); a trivial policy with no model would
call at once. An env that is honest while its calls come fast and lets any action win once they come
slowly (``tests/security/test_forging_envs.py``'s timing forger) would then pass its audit and give
every real play the win. So the rollout records the *gap* of each real turn — from the env's last
answer (its ``reset`` or previous ``step``) to the next ``step`` call — and each audit turn waits a gap
drawn from those records before it steps. Per turn, the env cannot tell an audit play from a real one
by when its calls come.

Gaps are recorded per env as well as for the worker. An audit draws from its own env's real gaps
(slot 0's real plays run beside it, under the same load): those are the only calls the env can
compare its audit's with. Drawing from every env's recent gaps instead took in the long turns of
busier moments (a designer's round decoding beside the plays: gaps of 8–10 s where this env's own were
1.3–7.3 s), and the audit then ran on alone for about 10 s after its env's real plays had ended.

What still differs, stated plainly: draws are independent, so a correlation within one real play
(later turns with longer prompts generating more slowly) is not reproduced; and an audit turn before
its env's first real gap waits for that gap (see :meth:`TurnPace.gap`).

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
from collections import OrderedDict, deque


class _Gaps:
    """Recorded gaps (the most recent ``keep``) and an event set by the first."""

    def __init__(self, keep: int) -> None:
        self.gaps: deque[float] = deque(maxlen=keep)
        self.first = asyncio.Event()
        self.waited_out = False  # a draw already waited its whole bound for the first gap

    def add(self, gap_s: float) -> None:
        self.gaps.append(gap_s)
        self.first.set()


class TurnPace:
    """The recent gaps of real turns, the worker's and each env's, and draws from them for audit turns.

    Args:
        keep: Gaps kept (the most recent), for the worker and for each env; older ones are forgotten, so
            the pace follows the load.
        first_gap_wait_s: Before any gap is recorded, how long a draw waits for the first one.
        envs: Envs whose gaps are kept (the most recently recorded); an audit runs beside its env's
            first real plays, so only envs in play now need theirs.
    """

    def __init__(self, keep: int = 512, first_gap_wait_s: float = 120.0, envs: int = 256) -> None:
        if keep < 1 or first_gap_wait_s < 0 or envs < 1:
            raise ValueError(
                f"keep and envs must be >= 1 and first_gap_wait_s >= 0, got {keep}, {envs} and {first_gap_wait_s}"
            )
        self.keep, self.envs = keep, envs
        self._all = _Gaps(keep)
        self._by_env: OrderedDict[str, _Gaps] = OrderedDict()
        self.first_gap_wait_s = first_gap_wait_s

    def __len__(self) -> int:
        return len(self._all.gaps)

    def _env(self, env_id: str) -> _Gaps:
        gaps = self._by_env.get(env_id)
        if gaps is None:
            gaps = self._by_env[env_id] = _Gaps(self.keep)
            while len(self._by_env) > self.envs:
                self._by_env.popitem(last=False)
        self._by_env.move_to_end(env_id)
        return gaps

    def record(self, gap_s: float, env_id: str | None = None) -> None:
        """One real turn's gap, in seconds (negative or not finite values are refused), of ``env_id``'s play."""
        if not 0.0 <= gap_s < float("inf"):
            raise ValueError(f"a turn's gap is a duration in seconds, got {gap_s!r}")
        self._all.add(gap_s)
        if env_id is not None:
            self._env(env_id).add(gap_s)

    async def gap(self, rng: random.Random, env_id: str | None = None) -> float:
        """A gap for one audit turn of ``env_id``: one of that env's recorded gaps, drawn with ``rng``.

        Before the env's first real gap (its audit starts with its first real plays) it waits for that
        gap, at most ``first_gap_wait_s``, and returns the time it waited: it started with the real
        plays, so that wait was itself a real turn's gap. If none came (no real turn of the env in
        flight: an audit resumed after its real plays were done), that draw and the env's later ones
        come from every env's recent gaps, or, with none recorded at all, are the time waited. Without
        ``env_id`` the draws come from every env's gaps, waiting likewise for the first.
        """
        own = self._all if env_id is None else self._env(env_id)
        if own.gaps:
            return rng.choice(own.gaps)
        if not own.waited_out:
            started = time.monotonic()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(own.first.wait(), timeout=self.first_gap_wait_s)
            if own.gaps or not self._all.gaps:
                return time.monotonic() - started
            own.waited_out = True  # every env's gaps are not empty from here on: they are never emptied
        return rng.choice(self._all.gaps)

    async def wait(self, rng: random.Random, env_id: str | None = None) -> float:
        """Sleep one audit turn's :meth:`gap` (counted from now) and return it."""
        started = time.monotonic()
        gap = await self.gap(rng, env_id)
        remaining = gap - (time.monotonic() - started)
        if remaining > 0:
            await asyncio.sleep(remaining)
        return gap
