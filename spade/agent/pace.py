"""The pace of real plays, so that audit plays keep the same time between an env's calls.

An env can read a clock. A real play calls ``step()`` only after the model has generated its turn
(seconds on this machine's CPU, about a second on a GPU server); a trivial policy with no model would
call at once. An env that is honest while its calls come fast and lets any action win once they come
slowly (``tests/security/test_forging_envs.py``'s timing forger) would then pass its audit and give
every real play the win. So the rollout records the *gap* of each real turn — from the env's last
answer (its ``reset`` or previous ``step``) to the next ``step`` call — and each audit turn waits a gap
drawn from those records before it steps. Per turn, the env cannot tell an audit play from a real one
by when its calls come. The gaps are kept per env as well, and an env's audit draws from its own real
turns' gaps once there are any (its real plays run beside it): a real play's pace depends on what runs
beside it (a designer round's long prefills, the batch's size), and an env's own gaps are the
distribution its real plays see. Until its first real turn is done, it draws from every env's.

What still differs, stated plainly: draws are independent, so a correlation within one real play
(later turns with longer prompts generating more slowly) is not reproduced; and the first audit of a
worker that has recorded nothing yet waits for the first real gap (see :meth:`TurnPace.gap`).

>>> import asyncio, random
>>> pace = TurnPace(first_gap_wait_s=0.0)
>>> for gap in (2.0, 3.0, 4.0):
...     pace.record(gap)
>>> asyncio.run(pace.gap(random.Random(0))) in (2.0, 3.0, 4.0)
True
>>> pace.record(0.5, env_id="env-a")
>>> asyncio.run(pace.gap(random.Random(0), env_id="env-a"))
0.5
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import OrderedDict, deque


class TurnPace:
    """The recent gaps of real turns, over all envs and per env, and draws from them for audit turns.

    Args:
        keep: Gaps kept (the most recent), over all envs and for each env; older ones are forgotten,
            so the pace follows the load.
        first_gap_wait_s: Before any gap is recorded, how long a draw waits for the first one.
        envs: Envs whose own gaps are kept (the most recently recorded); an env forgotten draws from
            every env's gaps again.
    """

    def __init__(self, keep: int = 512, first_gap_wait_s: float = 120.0, envs: int = 256) -> None:
        if keep < 1 or first_gap_wait_s < 0 or envs < 1:
            raise ValueError(
                f"keep and envs must be >= 1 and first_gap_wait_s >= 0, got {keep}, {envs} and {first_gap_wait_s}"
            )
        self._gaps: deque[float] = deque(maxlen=keep)
        self._by_env: OrderedDict[str, deque[float]] = OrderedDict()
        self._first = asyncio.Event()
        self.keep, self.envs = keep, envs
        self.first_gap_wait_s = first_gap_wait_s

    def __len__(self) -> int:
        return len(self._gaps)

    def record(self, gap_s: float, env_id: str | None = None) -> None:
        """One real turn's gap, in seconds (negative or not finite values are refused), of ``env_id``'s
        play when given."""
        if not 0.0 <= gap_s < float("inf"):
            raise ValueError(f"a turn's gap is a duration in seconds, got {gap_s!r}")
        self._gaps.append(gap_s)
        if env_id is not None:
            own = self._by_env.pop(env_id, None)
            self._by_env[env_id] = own = own if own is not None else deque(maxlen=self.keep)
            own.append(gap_s)
            while len(self._by_env) > self.envs:
                self._by_env.popitem(last=False)
        self._first.set()

    async def gap(self, rng: random.Random, env_id: str | None = None) -> float:
        """A gap for one audit turn: one of ``env_id``'s recorded gaps, else one of every env's, drawn
        with ``rng``.

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
        own = self._by_env.get(env_id) if env_id is not None else None
        return rng.choice(own if own else self._gaps)

    async def wait(self, rng: random.Random, env_id: str | None = None) -> float:
        """Sleep one audit turn's :meth:`gap` (counted from now) and return it."""
        started = time.monotonic()
        gap = await self.gap(rng, env_id)
        remaining = gap - (time.monotonic() - started)
        if remaining > 0:
            await asyncio.sleep(remaining)
        return gap
