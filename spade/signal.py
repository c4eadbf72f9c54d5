"""The SPADE signal: one definition of each quantity, imported by every service that uses it.

The memory's stored statistics, the learner's rewards and advantages, the run's metrics, the report
and ``spade eval`` all compute these quantities through this module and nowhere else (DESIGN §5), so
the examples the designer is shown and the reward it is trained on can never disagree.

Pure Python (the standard library and ``spade.envs.types``): no torch, no I/O, no service imports.

Which plays feed the signal is decided here too, for every consumer (the learner's windows, the
memory's statistics, the run's metrics):

- ``counted_return``: a play's return, 0 when it ended in a resource fault (the env failed the agent);
- ``slot0_arms``: the (seed, counted return) pairs of slot 0's hinted and unhinted arms (regret);
- ``window_returns``: the counted returns of the unhinted plays of slots ``0..k-1`` (window win rate).

- ``win_rate``: mean return over plays; returns lie in [0, 1].
- ``solved_fraction``: share of plays with return >= 1 (display only, never a reward).
- ``learnable``: win rate in [0.2, 0.8] (the paper's metric).
- ``trivially_won``: a trivial policy's audit plays reach a win rate above the run's threshold (the
  audit's retire decision).
- ``regret``: mean hinted return minus mean unhinted return, both arms on the same seeds the same
  number of times (at the env's first window version); anything else raises.
- ``regret_norm``: ``clip(regret / 0.15, 0, 1)``.
- ``plateau(w)``: 1 on [0.4, 0.6], linear to 0 at 0.15 and 0.85.
- ``chance_corrected(w, t)``: the win rate above what a trivial policy gets, ``max(0, (w - t) / (1 - t))``
  (``t``: the best trivial policy's audit win rate; 0 leaves ``w`` as it is).
- ``designer_blend``: ``0.4 * regret_norm + 0.6 * plateau(chance_corrected(w, t))``; invalid attempts get 0, or with the
  optional validity shaping a penalty ``-w * (1 - fraction of checks passed)`` in ``[-w, 0]``: shaping
  orders invalid attempts among themselves and never pays one more than the smallest reward a valid
  env can earn (0).
- ``group_zscores``: the agent's advantage within one group (one env, one version, one arm);
  ``group_has_signal``: whether a group's returns can train at all (two or more, not all equal).
- ``designer_advantages``: blend minus the mean blend of the same skill in the round; a skill group
  with fewer than 2 scored envs is centred on the running mean of that skill's recent blends.

>>> win_rate([1.0, 0.0, 0.5])
0.5
>>> solved_fraction([1.0, 0.0, 0.5])
0.3333333333333333
>>> learnable(0.5), learnable(0.9)
(True, False)
>>> plateau(0.5), plateau(0.15), plateau(0.3)
(1.0, 0.0, 0.6)
>>> regret([(1, 1.0), (2, 1.0)], [(2, 0.0), (1, 0.5)])
0.75
>>> round(designer_blend(0.06, 0.5).blend, 6)
0.76
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from spade.envs.types import FinishReason

LEARNABLE_BAND: tuple[float, float] = (0.2, 0.8)
"""Win rates in this closed interval make an environment learnable (the paper's metric)."""

SOLVED_RETURN = 1.0
"""A play whose return reaches this solved its instance (the env's win reward)."""


class SignalPlay(Protocol):
    """What the signal reads of a play (the learner's, the memory's and the rollout's records all have it)."""

    @property
    def seed(self) -> int: ...
    @property
    def hinted(self) -> bool: ...
    @property
    def episode_return(self) -> float: ...
    @property
    def window_index(self) -> int: ...
    @property
    def finish_reason(self) -> str | None: ...


def counted_return(play: SignalPlay) -> float:
    """The return a play counts with: 0 when it ended in a resource fault (the env failed the agent)."""
    return 0.0 if FinishReason.names_resource_fault(play.finish_reason) else play.episode_return


def slot0_arms(plays: Iterable[SignalPlay]) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """Slot 0's hinted and unhinted arms as (seed, counted return) pairs, the input of ``regret``."""
    hinted: list[tuple[int, float]] = []
    unhinted: list[tuple[int, float]] = []
    for p in plays:
        if p.window_index == 0:
            (hinted if p.hinted else unhinted).append((p.seed, counted_return(p)))
    return hinted, unhinted


def window_returns(plays: Iterable[SignalPlay], window_versions: int | None) -> list[float]:
    """The counted returns of the unhinted plays of slots ``0..k-1`` (every slot when ``k`` is unknown)."""
    return [
        counted_return(p)
        for p in plays
        if not p.hinted and p.window_index >= 0 and (window_versions is None or p.window_index < window_versions)
    ]


class SignalError(ValueError):
    """Inputs that break a rule of the signal (the message names the rule, the value and the fix)."""


class MismatchedArmsError(SignalError):
    """The hinted and unhinted arms were not played on the same seeds the same number of times."""


def _finite(value: float, name: str) -> float:
    if not isinstance(value, int | float) or not math.isfinite(value):
        raise SignalError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _returns(returns: Iterable[float], what: str) -> list[float]:
    values = [_finite(r, f"{what} return") for r in returns]
    if not values:
        raise SignalError(f"{what}: no plays; a rate over zero plays is undefined (check before asking for it)")
    for r in values:
        if not 0.0 <= r <= 1.0:
            raise SignalError(f"{what}: return {r} lies outside [0, 1]; episode returns are rewards in [0, 1]")
    return values


def clip(value: float, low: float, high: float) -> float:
    """``value`` clipped into ``[low, high]``."""
    return min(max(value, low), high)


def win_rate(returns: Iterable[float]) -> float:
    """Mean return over plays (returns lie in [0, 1]).

    Raises:
        SignalError: No plays, or a return outside [0, 1] or not finite.
    """
    values = _returns(returns, "win_rate")
    return sum(values) / len(values)


def trivially_won(returns: Iterable[float], max_win_rate: float) -> bool:
    """Whether a trivial policy's audit plays (a constant or random action) won too often.

    The audit's retire decision: the :func:`win_rate` of one trivial policy's plays above
    ``max_win_rate`` (the run spec's ``audit_max_win_rate``) means the env's reward does not depend
    on solving it. A resource fault counts 0, as everywhere (pass :func:`counted_return` values).

    >>> trivially_won([1.0], 0.5), trivially_won([0.0, 1.0], 0.5), trivially_won([0.6, 0.6], 0.5)
    (True, False, True)

    Raises:
        SignalError: No plays, a return outside [0, 1], or ``max_win_rate`` outside [0, 1).
    """
    if not 0.0 <= max_win_rate < 1.0:
        raise SignalError(f"max_win_rate must lie in [0, 1) (1 could never be exceeded), got {max_win_rate}")
    return win_rate(returns) > max_win_rate


def solved_fraction(returns: Iterable[float]) -> float:
    """Share of plays whose return reached :data:`SOLVED_RETURN` (for display only)."""
    values = _returns(returns, "solved_fraction")
    return sum(1.0 for r in values if r >= SOLVED_RETURN) / len(values)


def learnable(rate: float, band: tuple[float, float] = LEARNABLE_BAND) -> bool:
    """Whether a win rate lies in the learnable band (the paper's metric: [0.2, 0.8])."""
    w = _finite(rate, "win_rate")
    return band[0] <= w <= band[1]


def learnable_fraction(rates: Iterable[float], band: tuple[float, float] = LEARNABLE_BAND) -> float | None:
    """Share of environments whose win rate is learnable; ``None`` when no environment has a win rate."""
    flags = [learnable(r, band) for r in rates]
    return sum(flags) / len(flags) if flags else None


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
            raise SignalError(
                "plateau band must satisfy 0 <= zero_low < low <= high < zero_high <= 1, got "
                f"({self.zero_low}, {self.low}, {self.high}, {self.zero_high}); fix the band configuration"
            )


def plateau(rate: float, band: PlateauBand = PlateauBand()) -> float:
    """The difficulty plateau of a win rate: 1 on ``[low, high]``, linear to 0 at the band's zeros.

    Raises:
        SignalError: ``rate`` is not a finite number in [0, 1].
    """
    w = _finite(rate, "win_rate")
    if not 0.0 <= w <= 1.0:
        raise SignalError(f"win_rate must lie in [0, 1], got {w}; returns are rewards in [0, 1]")
    if band.low <= w <= band.high:
        return 1.0
    if w < band.low:
        return max(0.0, (w - band.zero_low) / (band.low - band.zero_low))
    return max(0.0, (band.zero_high - w) / (band.zero_high - band.high))


def chance_corrected(rate: float, trivial_rate: float) -> float:
    """The win rate above what a trivial policy gets on the same env, rescaled to [0, 1].

    ``max(0, (rate - trivial_rate) / (1 - trivial_rate))``: what the agent's plays earned beyond a
    constant or random action (the audit's, on the env's own rollout seeds). An env that pays 0.5 to any
    action has an agent win rate of 0.5 and a trivial one of 0.5: 0 here, so the difficulty plateau,
    which measures the agent's ability, pays it nothing (it would otherwise sit at the plateau's top
    while teaching nothing). With ``trivial_rate`` 0 (no audit, or no trivial win) the rate is unchanged.

    >>> [chance_corrected(w, t) for w, t in ((0.5, 0.5), (0.5, 0.0), (0.625, 0.25), (0.1, 0.3))]
    [0.0, 0.5, 0.5, 0.0]

    Raises:
        SignalError: Either rate not finite or outside [0, 1], or ``trivial_rate`` equal to 1.
    """
    w, t = _finite(rate, "win_rate"), _finite(trivial_rate, "trivial win_rate")
    if not (0.0 <= w <= 1.0 and 0.0 <= t < 1.0):
        raise SignalError(
            f"win rates must lie in [0, 1] and a trivial one below 1 (such an env is retired), got {w} and {t}"
        )
    return max(0.0, (w - t) / (1.0 - t))


def regret(hinted: Sequence[tuple[int, float]], unhinted: Sequence[tuple[int, float]]) -> float:
    """Hint-based regret: mean hinted return minus mean unhinted return.

    Both arms are ``(seed, return)`` pairs from the env's first window version. They must come from
    the same seeds, each seed played the same number of times in both arms: otherwise the two means
    measure different instances and the difference is meaningless (the reference implementation's
    defect), so this raises instead of returning a number.

    Raises:
        MismatchedArmsError: The arms differ in seeds or counts.
        SignalError: An arm is empty or holds a return outside [0, 1].
    """
    if not hinted or not unhinted:
        raise SignalError(f"regret needs plays in both arms; got {len(hinted)} hinted and {len(unhinted)} unhinted")
    mean_h = win_rate(r for _, r in hinted)
    mean_u = win_rate(r for _, r in unhinted)
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
    return mean_h - mean_u


def regret_norm(value: float, scale: float = 0.15) -> float:
    """``clip(regret / scale, 0, 1)`` (the paper's scale 0.15 saturates the term)."""
    if scale <= 0:
        raise SignalError(f"regret scale must be > 0, got {scale}; the paper uses 0.15")
    return clip(_finite(value, "regret") / scale, 0.0, 1.0)


@dataclass(frozen=True)
class DesignerRewardConfig:
    """Weights of the designer blend; the defaults are the paper's.

    Attributes:
        regret_weight: Weight of the normalised regret (0.4).
        plateau_weight: Weight of the plateau of the window win rate (0.6).
        regret_scale: Regret that saturates the regret term (0.15).
        band: The plateau band.
        validity_shaping_weight: Penalty per unit fraction of validation checks *failed*, for invalid
            attempts only: ``-w * (1 - fraction passed)``. 0 (the default, and the paper) turns shaping
            off: invalid attempts get 0. Shaping is a penalty, never a bonus, so no invalid attempt
            outbids a valid env (whose blend is >= 0) however many checks it passed.
    """

    regret_weight: float = 0.4
    plateau_weight: float = 0.6
    regret_scale: float = 0.15
    band: PlateauBand = PlateauBand()
    validity_shaping_weight: float = 0.0

    def __post_init__(self) -> None:
        if self.regret_scale <= 0:
            raise SignalError(f"regret_scale must be > 0, got {self.regret_scale}; the paper uses 0.15")
        for name in ("regret_weight", "plateau_weight", "validity_shaping_weight"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise SignalError(f"{name} must be a finite number >= 0, got {value}")


@dataclass(frozen=True)
class DesignerRewardComponents:
    """Every term of one designer reward, for metrics, the memory and the report.

    ``regret``, ``regret_norm``, ``window_win_rate`` and ``plateau`` are ``None`` for an invalid
    attempt (nothing was played). ``plateau`` is taken of :func:`chance_corrected` (``window_win_rate``,
    ``trivial_win_rate``).
    """

    valid: bool
    regret: float | None
    regret_norm: float | None
    window_win_rate: float | None
    plateau: float | None
    validity_fraction: float | None
    blend: float
    trivial_win_rate: float | None = None


def validity_fraction(passed: Iterable[bool]) -> float:
    """Fraction of validation checks passed (0 when there were none)."""
    flags = list(passed)
    return sum(flags) / len(flags) if flags else 0.0


def shaping_penalty(fraction_passed: float | None, weight: float) -> float:
    """The validity shaping of an invalid attempt: ``-weight * (1 - fraction_passed)``, in ``[-weight, 0]``.

    ``None`` (nothing was checked: the answer was malformed) counts as no check passed. Rounded to
    12 places so a shaped blend prints as the arithmetic a reader expects.
    """
    if weight == 0:
        return 0.0
    passed = 0.0 if fraction_passed is None else clip(fraction_passed, 0.0, 1.0)
    return round(-weight * (1.0 - passed), 12)


def designer_blend(
    regret_value: float | None,
    window_win_rate: float | None,
    valid: bool = True,
    config: DesignerRewardConfig = DesignerRewardConfig(),
    validity_fraction_value: float | None = None,
    trivial_win_rate: float = 0.0,
) -> DesignerRewardComponents:
    """The designer's reward ``w_r * regret_norm(regret) + w_p * plateau(chance_corrected(w, t))``.

    An invalid attempt gets 0, or ``-validity_shaping_weight * (1 - validity_fraction)`` when shaping
    is configured (off by default): at most 0, the smallest blend a valid env can earn, and strictly
    below it for any attempt that failed a check. Shaping therefore ranks a nearly-valid attempt above
    a malformed one but never above a valid env the agent cannot yet win.

    >>> config = DesignerRewardConfig(validity_shaping_weight=0.2)
    >>> designer_blend(None, None, False, config, 0.8).blend, designer_blend(None, None, False, config, 0.0).blend
    (-0.04, -0.2)
    >>> designer_blend(0.0, 0.0, True, config).blend
    0.0
    >>> designer_blend(0.0, 0.5).blend, designer_blend(0.0, 0.5, trivial_win_rate=0.5).blend  # pays any action 0.5
    (0.6, 0.0)

    Args:
        regret_value: :func:`regret` at the env's first window version (ignored when invalid).
        window_win_rate: :func:`win_rate` of the unhinted plays over the env's whole window.
        valid: Whether the attempt produced a stored, validated environment.
        config: Weights, scale, band and shaping.
        validity_fraction_value: Fraction of validation checks passed, for shaping invalid attempts.
        trivial_win_rate: The best trivial policy's win rate in the env's audit (0: none, or no audit).

    Raises:
        SignalError: A valid env without regret or win rate, or non-finite inputs.
    """
    if not valid:
        frac = None if validity_fraction_value is None else clip(validity_fraction_value, 0.0, 1.0)
        blend = shaping_penalty(frac, config.validity_shaping_weight)
        return DesignerRewardComponents(False, None, None, None, None, frac, blend)
    if regret_value is None or window_win_rate is None:
        raise SignalError(
            "a valid environment needs both its regret and its window win rate; "
            f"got regret={regret_value}, window_win_rate={window_win_rate}"
        )
    r = _finite(regret_value, "regret")
    r_norm = regret_norm(r, config.regret_scale)
    t = _finite(trivial_win_rate, "trivial win_rate")
    p = plateau(chance_corrected(window_win_rate, t), config.band)
    blend = config.regret_weight * r_norm + config.plateau_weight * p
    return DesignerRewardComponents(True, r, r_norm, float(window_win_rate), p, None, blend, t)


def group_zscores(returns: Sequence[float], eps: float = 1e-6) -> list[float] | None:
    """The agent's advantages: z-scores of one group's returns, ``None`` when the group has no variance.

    A group is the plays of one env at one weight version in one arm. Uses the population std; a
    group whose std is below ``eps`` carries no learning signal.

    >>> group_zscores([1.0, 0.0])
    [1.0, -1.0]
    >>> group_zscores([0.5, 0.5]) is None
    True
    """
    if not returns:
        raise SignalError("a group needs at least one return")
    values = [_finite(r, "return") for r in returns]
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
    if std < eps:
        return None
    return [(v - mean) / std for v in values]


def group_has_signal(returns: Sequence[float], eps: float = 1e-6) -> bool:
    """Whether one group's returns can train: at least two of them, not all equal (``group_zscores``).

    The rollout asks this before it extends a group with fresh seeds, the learner before it trains one.

    >>> group_has_signal([0.0, 0.0, 0.0]), group_has_signal([0.0, 0.25]), group_has_signal([1.0])
    (False, True, False)
    """
    return len(returns) >= 2 and group_zscores(returns, eps) is not None


@dataclass
class SkillBaselines:
    """Running means of each skill's recent designer blends (the fallback centre of small groups).

    Plain data (``to_dict``/``from_dict``), so the learner persists it with its checkpoint and a
    restart centres exactly as before.

    Args:
        length: How many recent blends of a skill the running mean covers.
    """

    length: int = 32
    recent: dict[str, deque[float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.length < 1:
            raise SignalError(f"the skill baseline length must be >= 1 blend, got {self.length}")
        self.recent = {k: deque(v, maxlen=self.length) for k, v in self.recent.items()}

    def mean(self, skill: str) -> float | None:
        """The running mean of ``skill``'s recent blends; ``None`` before its first blend."""
        values = self.recent.get(skill)
        return sum(values) / len(values) if values else None

    def add(self, skill: str, blends: Iterable[float]) -> None:
        """Remember ``blends`` as ``skill``'s most recent ones."""
        self.recent.setdefault(skill, deque(maxlen=self.length)).extend(_finite(b, "blend") for b in blends)

    def to_dict(self) -> dict[str, Any]:
        return {"length": self.length, "recent": {k: list(v) for k, v in self.recent.items()}}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SkillBaselines:
        return cls(length=int(data["length"]), recent={k: deque(v) for k, v in data["recent"].items()})


def designer_advantages(
    blends: Sequence[float], skills: Sequence[str], baselines: SkillBaselines, *, min_group: int = 2
) -> list[float]:
    """The designer's advantages for one round: each blend minus the mean blend of its skill in the round.

    A skill with fewer than ``min_group`` scored envs in the round is centred on the running mean of
    that skill's recent blends instead, never dropped; before any blend of that skill was seen, on the
    mean blend of the whole round.
    Afterwards the round's blends are added to ``baselines``.

    >>> b = SkillBaselines(length=4)
    >>> [round(a, 6) for a in designer_advantages([0.8, 0.2, 0.5], ["logic", "logic", "math"], b)]
    [0.3, -0.3, 0.0]
    >>> [round(a, 6) for a in designer_advantages([0.7], ["math"], b)]
    [0.2]
    """
    if len(blends) != len(skills):
        raise SignalError(f"got {len(blends)} blends but {len(skills)} skills; they must pair up")
    values = [_finite(b, "blend") for b in blends]
    groups: dict[str, list[float]] = {}
    for value, skill in zip(values, skills, strict=True):
        groups.setdefault(skill, []).append(value)
    round_mean = sum(values) / len(values) if values else 0.0
    centres: dict[str, float] = {}
    for skill, group in groups.items():
        if len(group) >= min_group:
            centres[skill] = sum(group) / len(group)
        else:
            running = baselines.mean(skill)
            centres[skill] = running if running is not None else round_mean
    advantages = [value - centres[skill] for value, skill in zip(values, skills, strict=True)]
    for skill, group in groups.items():
        baselines.add(skill, group)
    return advantages
