"""SPADE reward maths: pure functions, no torch, no I/O.

The designer (ED) is rewarded for environments at the edge of the agent's ability: solvable with the
hint (high regret), neither trivial nor hopeless without it (plateau of the windowed win rate). The
agent (RA) is rewarded by its episode return, turned into a z-score within its group.

>>> plateau(0.5), plateau(0.15), plateau(0.3)
(1.0, 0.0, 0.6)
>>> regret([(1, 1.0), (2, 1.0)], [(2, 0.0), (1, 0.5)])
0.75
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


class RewardError(ValueError):
    """Reward inputs that break a rule (the message names the rule, the value and the fix)."""


class MismatchedArmsError(RewardError):
    """The hinted and unhinted arms were not played on the same seeds the same number of times."""


@dataclass(frozen=True)
class PlateauBand:
    """The difficulty plateau: 1 on ``[low, high]``, linear to 0 at ``zero_low`` and ``zero_high``.

    Defaults are the paper's (0.15, 0.4, 0.6, 0.85).
    """

    zero_low: float = 0.15
    low: float = 0.4
    high: float = 0.6
    zero_high: float = 0.85

    def __post_init__(self) -> None:
        if not (0.0 <= self.zero_low < self.low <= self.high < self.zero_high <= 1.0):
            raise RewardError(
                "plateau band must satisfy 0 <= zero_low < low <= high < zero_high <= 1, got "
                f"({self.zero_low}, {self.low}, {self.high}, {self.zero_high}); fix the band configuration"
            )


@dataclass(frozen=True)
class DesignerRewardConfig:
    """Weights of the designer blend; the defaults are the paper's.

    Attributes:
        regret_weight: Weight of the normalised regret (0.4).
        plateau_weight: Weight of the plateau of the window win rate (0.6).
        regret_scale: Regret that saturates the regret term (0.15).
        band: The plateau band.
        validity_shaping_weight: Reward per unit fraction of validation checks passed, for invalid
            attempts only. 0 (the default) turns shaping off: invalid attempts get exactly 0.
    """

    regret_weight: float = 0.4
    plateau_weight: float = 0.6
    regret_scale: float = 0.15
    band: PlateauBand = PlateauBand()
    validity_shaping_weight: float = 0.0

    def __post_init__(self) -> None:
        if self.regret_scale <= 0:
            raise RewardError(f"regret_scale must be > 0, got {self.regret_scale}; the paper uses 0.15")
        for name in ("regret_weight", "plateau_weight", "validity_shaping_weight"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise RewardError(f"{name} must be a finite number >= 0, got {value}")


@dataclass(frozen=True)
class DesignerRewardComponents:
    """Every term of one designer reward, for metrics and the memory service.

    ``regret``, ``regret_norm``, ``window_win_rate`` and ``plateau`` are ``None`` for an invalid
    attempt (nothing was played).
    """

    valid: bool
    regret: float | None
    regret_norm: float | None
    window_win_rate: float | None
    plateau: float | None
    validity_fraction: float | None
    blend: float


def _finite(value: float, name: str) -> float:
    if not math.isfinite(value):
        raise RewardError(f"{name} must be finite, got {value}")
    return float(value)


def clip(value: float, low: float, high: float) -> float:
    """``value`` clipped into ``[low, high]``."""
    return min(max(value, low), high)


def plateau(win_rate: float, band: PlateauBand = PlateauBand()) -> float:
    """The difficulty plateau of a win rate.

    1 on ``[band.low, band.high]``, falling linearly to 0 at ``band.zero_low`` and
    ``band.zero_high``, 0 outside.

    Args:
        win_rate: Mean unhinted return, in [0, 1].
        band: The plateau band (paper defaults).

    Raises:
        RewardError: ``win_rate`` is not a finite number in [0, 1].
    """
    w = _finite(win_rate, "win_rate")
    if not 0.0 <= w <= 1.0:
        raise RewardError(f"win_rate must lie in [0, 1], got {w}; returns are rewards in [0, 1]")
    if band.low <= w <= band.high:
        return 1.0
    if w < band.low:
        return max(0.0, (w - band.zero_low) / (band.low - band.zero_low))
    return max(0.0, (band.zero_high - w) / (band.zero_high - band.high))


def _check_arm(arm: Sequence[tuple[int, float]], name: str) -> None:
    if not arm:
        raise RewardError(f"{name} arm is empty: regret needs at least one play per arm")
    for seed, ret in arm:
        _finite(ret, f"{name} return for seed {seed}")


def regret(hinted: Sequence[tuple[int, float]], unhinted: Sequence[tuple[int, float]]) -> float:
    """Hint-based regret: mean hinted return minus mean unhinted return.

    Both arms are ``(seed, return)`` pairs. They must come from the same seeds, each seed played the
    same number of times in both arms: otherwise the two means measure different instances and the
    difference is meaningless (the reference implementation's defect), so this raises instead.

    Raises:
        MismatchedArmsError: The arms differ in seeds or counts.
        RewardError: An arm is empty or holds a non-finite return.
    """
    _check_arm(hinted, "hinted")
    _check_arm(unhinted, "unhinted")
    hinted_seeds = Counter(seed for seed, _ in hinted)
    unhinted_seeds = Counter(seed for seed, _ in unhinted)
    if hinted_seeds != unhinted_seeds:
        only_h = sorted((hinted_seeds - unhinted_seeds).elements())
        only_u = sorted((unhinted_seeds - hinted_seeds).elements())
        raise MismatchedArmsError(
            f"regret arms must be played on the same seeds the same number of times: "
            f"{len(hinted)} hinted vs {len(unhinted)} unhinted plays, seeds only hinted {only_h[:8]}, "
            f"only unhinted {only_u[:8]}; the rollout must play both arms on identical seeds"
        )
    mean_h = sum(r for _, r in hinted) / len(hinted)
    mean_u = sum(r for _, r in unhinted) / len(unhinted)
    return mean_h - mean_u


def validity_fraction(passed: Iterable[bool]) -> float:
    """Fraction of validation checks passed (0 when there were none)."""
    flags = list(passed)
    return sum(flags) / len(flags) if flags else 0.0


def designer_reward(
    regret_value: float | None,
    window_win_rate: float | None,
    valid: bool,
    config: DesignerRewardConfig = DesignerRewardConfig(),
    validity_fraction_value: float | None = None,
) -> DesignerRewardComponents:
    """The designer blend ``w_r·clip(regret/scale, 0, 1) + w_p·plateau(win_rate)``.

    An invalid attempt gets 0, or ``validity_shaping_weight × validity_fraction`` when shaping is
    configured (it is off by default).

    Args:
        regret_value: ``regret(hinted, unhinted)`` at the env's first version (ignored when invalid).
        window_win_rate: Mean unhinted return over the env's whole window (ignored when invalid).
        valid: Whether the attempt produced a stored, validated environment.
        config: Weights, scale, band and shaping.
        validity_fraction_value: Fraction of validation checks passed, for shaping invalid attempts.

    Raises:
        RewardError: A valid env without regret or win rate, or non-finite inputs.
    """
    if not valid:
        frac = None if validity_fraction_value is None else clip(validity_fraction_value, 0.0, 1.0)
        blend = config.validity_shaping_weight * frac if frac is not None else 0.0
        return DesignerRewardComponents(False, None, None, None, None, frac, blend)
    if regret_value is None or window_win_rate is None:
        raise RewardError(
            "a valid environment needs both its regret and its window win rate; "
            f"got regret={regret_value}, window_win_rate={window_win_rate}"
        )
    r = _finite(regret_value, "regret")
    r_norm = clip(r / config.regret_scale, 0.0, 1.0)
    p = plateau(window_win_rate, config.band)
    blend = config.regret_weight * r_norm + config.plateau_weight * p
    return DesignerRewardComponents(True, r, r_norm, float(window_win_rate), p, None, blend)


def center_by_key(rewards: Sequence[float], keys: Sequence[str]) -> list[float]:
    """Mean-centre rewards within each key (e.g. skill), without dividing by the std.

    >>> center_by_key([1.0, 0.0, 0.5], ["a", "a", "b"])
    [0.5, -0.5, 0.0]
    """
    if len(rewards) != len(keys):
        raise RewardError(f"got {len(rewards)} rewards but {len(keys)} keys; they must pair up")
    sums: dict[str, float] = {}
    counts: Counter[str] = Counter()
    for r, k in zip(rewards, keys, strict=True):
        sums[k] = sums.get(k, 0.0) + _finite(r, "reward")
        counts[k] += 1
    return [r - sums[k] / counts[k] for r, k in zip(rewards, keys, strict=True)]


def group_zscores(returns: Sequence[float], eps: float = 1e-6) -> list[float] | None:
    """Z-scores of one group's returns, or ``None`` when the group has zero variance.

    Uses the population std (the group is the whole population of plays of one env at one weight
    version). A group whose std is below ``eps`` carries no learning signal and is dropped.

    >>> group_zscores([1.0, 0.0])
    [1.0, -1.0]
    >>> group_zscores([0.5, 0.5]) is None
    True
    """
    if not returns:
        raise RewardError("a group needs at least one return")
    values = [_finite(r, "return") for r in returns]
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
    if std < eps:
        return None
    return [(v - mean) / std for v in values]
