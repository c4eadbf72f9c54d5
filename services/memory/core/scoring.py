"""Per-environment statistics from its plays (pure; the store calls it after recording plays).

Definitions (DESIGN §5):

- a play *wins* when its return reaches ``win_threshold`` (1.0: the env's win reward);
- the *windowed win rate* is the win fraction of the unhinted plays whose weight version lies in the
  env's window ``[v0, v0 + window_versions)``, ``v0`` being the version that designed it;
- *regret* is mean hinted return minus mean unhinted return at ``v0``, over the seeds both arms
  played (the same seeds and count on each side, so a lopsided arm cannot bias it).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from spade.memory.records import EnvStats, Play


@dataclass(frozen=True)
class ScoringConfig:
    """How plays turn into statistics.

    Attributes:
        window_versions: ``k``: weight versions an environment stays active (its window).
        win_threshold: Minimum return that counts as a win.
        learnable_band: Win rates in this closed interval make an environment learnable.
    """

    window_versions: int = 4
    win_threshold: float = 1.0
    learnable_band: tuple[float, float] = (0.15, 0.85)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def score(
    plays: Iterable[Play], first_version: int, config: ScoringConfig, previous: EnvStats | None = None
) -> EnvStats:
    """Compute an environment's statistics from all of its plays.

    Args:
        plays: Every play recorded for the environment.
        first_version: The weight version that designed it (``v0``).
        config: Window, win threshold and learnable band.
        previous: Stored statistics; the learner's reward components are kept.

    Returns:
        Fresh ``EnvStats``. ``learnable`` follows the band unless the learner set it (recorded as the
        reward component ``learnable_override``).

    >>> ps = [Play("e", s, h, r, 3, 0, f"{s}{h}") for s, h, r in [(1, False, 0.0), (1, True, 1.0),
    ...       (2, False, 1.0), (2, True, 1.0), (3, True, 1.0)]]
    >>> st = score(ps, 0, ScoringConfig())
    >>> st.plays, st.window_plays, st.win_rate, st.regret, st.learnable
    (5, 2, 0.5, 0.5, True)
    """
    plays = list(plays)
    lo_v, hi_v = first_version, first_version + config.window_versions
    window = [p for p in plays if not p.hinted and lo_v <= p.weight_version < hi_v]
    win_rate = _mean([float(p.episode_return >= config.win_threshold) for p in window]) if window else None

    hinted: dict[int, list[float]] = {}
    unhinted: dict[int, list[float]] = {}
    for p in plays:
        if p.weight_version == first_version:
            (hinted if p.hinted else unhinted).setdefault(p.seed, []).append(p.episode_return)
    shared = sorted(hinted.keys() & unhinted.keys())
    regret = None
    if shared:
        # Pair play counts per seed too: the i-th hinted play of a seed against its i-th unhinted.
        pairs = [(h, u) for s in shared for h, u in zip(hinted[s], unhinted[s], strict=False)]
        regret = _mean([h for h, _ in pairs]) - _mean([u for _, u in pairs])

    components = dict(previous.reward_components) if previous else {}
    override = components.get("learnable_override")
    lo, hi = config.learnable_band
    learnable = bool(override) if override is not None else (win_rate is not None and lo <= win_rate <= hi)
    return EnvStats(
        plays=len(plays),
        window_plays=len(window),
        win_rate=win_rate,
        regret=regret,
        learnable=learnable,
        reward_components=components,
    )
