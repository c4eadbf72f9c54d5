"""Which pool envs a step of the embedded run plays: the ones most likely to carry a learning signal.

The pool (the family seed pool and any ``--pool``) is larger than one step's budget on a CPU, so
each step plays at most ``per_step`` of its envs beside every env the designer wrote (whose first
plays are never skipped: they measure its regret). The choice, from what the run has seen so far:

1. envs whose unhinted win rate lies in the learnable band (``spade.signal.learnable``), nearest to
   0.5 first — a GRPO group there has the most variance;
2. envs not played yet (in pool order);
3. the rest that still carried signal, nearest to 0.5 first;

and, within each tier, the env played least recently first, so a step after one that trained
nothing plays something new. An env whose groups had no variance in ``retire_after`` of its slots
in a row (every play the same return, even after the rollout's extension) is retired from the choice:
it only costs time.

>>> choice = PoolChoice(["a", "b", "c"], per_step=2, retire_after=2)
>>> choice.choose()
['a', 'b']
>>> choice.observe(1, {"a": [0.0, 0.0], "b": [0.2, 0.6]})
>>> choice.choose()
['b', 'c']
>>> choice.observe(2, {"b": [0.5, 0.3], "c": [1.0, 1.0]})
>>> choice.observe(3, {"a": [0.0, 0.0], "c": [1.0, 1.0]})
>>> choice.choose(), sorted(choice.retired)
(['b'], ['a', 'c'])
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from spade import signal


@dataclass
class PoolEnvHistory:
    """What the run has seen of one pool env.

    Attributes:
        env_id: The env.
        order: Its place in the pool (ties are broken by it).
        returns: Every unhinted return so far.
        slots: Slots played.
        barren: Slots in a row whose unhinted returns had no variance.
        last_step: The step that last played it (None: never played).
    """

    env_id: str
    order: int
    returns: list[float] = field(default_factory=list)
    slots: int = 0
    barren: int = 0
    last_step: int | None = None

    @property
    def win_rate(self) -> float | None:
        return signal.win_rate(self.returns) if self.returns else None


class PoolChoice:
    """Chooses the pool envs of each step (see the module docstring).

    Args:
        env_ids: The pool, in its order.
        per_step: Pool envs played per step.
        retire_after: Slots in a row without variance that retire an env from the choice.
    """

    def __init__(self, env_ids: Iterable[str], *, per_step: int, retire_after: int) -> None:
        if per_step < 1 or retire_after < 1:
            raise ValueError(f"per_step and retire_after must be >= 1, got {per_step} and {retire_after}")
        self.per_step = per_step
        self.retire_after = retire_after
        self.history = {env_id: PoolEnvHistory(env_id, i) for i, env_id in enumerate(env_ids)}

    @property
    def retired(self) -> set[str]:
        """Envs that stopped carrying signal (never chosen again)."""
        return {h.env_id for h in self.history.values() if h.barren >= self.retire_after}

    def _rank(self, h: PoolEnvHistory) -> tuple[int, int, float, int]:
        rate = h.win_rate
        if rate is None:
            tier, distance = 1, 0.0
        else:
            tier = 0 if signal.learnable(rate) and h.barren == 0 else 2
            distance = abs(rate - 0.5)
        last = -1 if h.last_step is None else h.last_step
        return (tier, last, distance, h.order)

    def choose(self, due: Collection[str] | None = None) -> list[str]:
        """The pool envs to play this step (at most ``per_step``), best first.

        Args:
            due: The envs that have a slot to play now (None: all). An env's next slot comes with the
                next weight version: after a step that published none (with the learner overlapped,
                step 2, which still plays on version 0) the envs just played wait, and others are chosen.
        """
        live = [h for h in self.history.values() if h.barren < self.retire_after and (due is None or h.env_id in due)]
        return [h.env_id for h in sorted(live, key=self._rank)[: self.per_step]]

    def skipped(self, chosen: Sequence[str]) -> set[str]:
        """Every pool env not in ``chosen``: the rollout leaves their slots for a later step."""
        return set(self.history) - set(chosen)

    def observe(self, step: int, returns: Mapping[str, Sequence[float]]) -> None:
        """Record a step's unhinted returns of the pool envs it played (others are ignored)."""
        for env_id, values in returns.items():
            h = self.history.get(env_id)
            if h is None or not values:
                continue
            h.returns.extend(values)
            h.slots += 1
            h.last_step = step
            h.barren = 0 if signal.group_has_signal(list(values)) else h.barren + 1
