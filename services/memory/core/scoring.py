"""Per-environment statistics from its plays (pure; the store calls it after recording plays).

Every quantity is ``spade.signal``'s (DESIGN §5, WAVE2 §1), and so is the choice of the plays that
feed it (``slot0_arms``, ``window_returns``): by the env's own window slots (WAVE2 §3), never by the
weight version that generated them:

- the **window win rate** is ``signal.win_rate`` of the unhinted plays of slots ``0..k-1``;
- the **regret** is ``signal.regret`` of slot 0's hinted and unhinted arms. It is strict: when the
  arms were not played on the same seeds the same number of times, no regret is stored and
  ``regret_note`` records why (``signal.MismatchedArmsError``'s message) — never a lenient number;
- **learnable** is ``signal.learnable`` of the window win rate, unless the learner set it;
- a play that ended in a **resource fault** counts as return 0 (``signal.counted_return``): the env
  failed the agent.

>>> ps = [Play("e", s, h, r, 3, 0, f"{s}{h}") for s, h, r in [(1, False, 0.0), (1, True, 1.0),
...       (2, False, 1.0), (2, True, 0.5)]]
>>> st = score(ps, window_versions=4)
>>> st.plays, st.window_plays, st.win_rate, st.regret, st.learnable, st.solved_fraction
(4, 2, 0.5, 0.25, True, 0.5)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from spade import signal
from spade.envs.types import FinishReason
from spade.memory.records import EnvStats, Play
from spade.pool_metrics import interaction_turns, reward_levels

LEARNABLE_OVERRIDE = "learnable_override"
"""Reward component recording that the learner set the learnable flag (1.0 / 0.0)."""


@dataclass(frozen=True)
class EnvShape:
    """Per-env process figures kept with the statistics (``spade.pool_metrics``).

    Attributes:
        reward_levels: Distinct reward values the env emitted over its plays (faults excluded).
        turns_mean: Mean turns per play (``None`` before the first play).
    """

    reward_levels: int
    turns_mean: float | None


def _regret(plays: list[Play]) -> tuple[float | None, str]:
    hinted, unhinted = signal.slot0_arms(plays)
    if not hinted and not unhinted:
        return None, ""
    if not hinted or not unhinted:
        return None, (f"slot 0 has {len(hinted)} hinted and {len(unhinted)} unhinted plays; regret needs both arms")
    try:
        return signal.regret(hinted, unhinted), ""
    except signal.SignalError as exc:
        return None, str(exc)


def score(plays: Iterable[Play], window_versions: int | None, previous: EnvStats | None = None) -> EnvStats:
    """Compute an environment's statistics from all of its plays.

    Args:
        plays: Every play recorded for the environment (returns in [0, 1]).
        window_versions: ``k``, the env's window length (``None``: unknown, every slot counts).
        previous: Stored statistics; the learner's reward components (and learnable flag) are kept.

    Returns:
        Fresh ``EnvStats``.
    """
    plays = list(plays)
    window = signal.window_returns(plays, window_versions)
    win_rate = signal.win_rate(window) if window else None
    regret, note = _regret(plays)
    components = dict(previous.reward_components) if previous else {}
    override = components.get(LEARNABLE_OVERRIDE)
    learnable = bool(override) if override is not None else win_rate is not None and signal.learnable(win_rate)
    return EnvStats(
        plays=len(plays),
        window_plays=len(window),
        win_rate=win_rate,
        regret=regret,
        learnable=learnable,
        reward_components=components,
        solved_fraction=signal.solved_fraction(window) if window else None,
        regret_note=note,
    )


def shape(plays: Iterable[Play]) -> EnvShape:
    """The env's reward levels and mean turns over its plays (``spade.pool_metrics``)."""
    plays = list(plays)
    rewards = [p.episode_return for p in plays if not FinishReason.names_resource_fault(p.finish_reason)]
    return EnvShape(reward_levels=reward_levels(rewards), turns_mean=interaction_turns(p.turns for p in plays))
