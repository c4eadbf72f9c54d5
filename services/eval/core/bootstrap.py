"""Bootstrap intervals: a mean with its percentile interval, and a paired difference of two means.

Both are numpy percentile bootstraps with a seeded generator, so the same scores always give the
same interval. A paired bootstrap resamples *items* (the same indices in both arms), which is what
makes a difference between two checkpoints on the same items much tighter than two independent
intervals would suggest.

>>> iv = mean_interval([1.0, 1.0, 1.0], resamples=200, seed=0)
>>> (iv.mean, iv.low, iv.high, iv.n)
(1.0, 1.0, 1.0, 3)
>>> d = paired_difference([0.0, 0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0], resamples=500, seed=0)
>>> d.mean, d.low > 0.0
(0.75, True)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

DEFAULT_RESAMPLES = 2000
"""Bootstrap resamples when the caller does not say (enough for a stable 95 % interval)."""

DEFAULT_CONFIDENCE = 0.95
"""Coverage of the reported intervals."""


@dataclass(frozen=True)
class Interval:
    """A mean and its bootstrap interval.

    Attributes:
        mean: The sample mean (of the scores, or of the paired differences).
        low: Lower end of the percentile interval.
        high: Upper end of the percentile interval.
        n: Items the mean is over.
        confidence: Coverage of ``[low, high]``.
    """

    mean: float
    low: float
    high: float
    n: int
    confidence: float = DEFAULT_CONFIDENCE

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready mapping."""
        return asdict(self)

    def __str__(self) -> str:
        pct = round(self.confidence * 100)
        return f"{self.mean:.3f} [{self.low:.3f}, {self.high:.3f}] ({pct}% CI, n={self.n})"


def _check(resamples: int, confidence: float) -> None:
    if not 1 <= resamples <= 1_000_000:
        raise ValueError(f"resamples must lie in [1, 1000000], got {resamples}; 2000 is the usual choice")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}; e.g. 0.95 for a 95% interval")


def _percentile_interval(values: np.ndarray, resamples: int, confidence: float, seed: int) -> Interval:
    n = int(values.shape[0])
    mean = float(values.mean())
    if n == 1:
        return Interval(mean, mean, mean, 1, confidence)
    rng = np.random.default_rng(seed)
    indices = rng.integers(0, n, size=(resamples, n))
    means = values[indices].mean(axis=1)
    alpha = (1.0 - confidence) / 2.0
    low, high = np.percentile(means, [100.0 * alpha, 100.0 * (1.0 - alpha)])
    # Clamp against floating-point noise so a constant sample reports exactly its value.
    return Interval(mean, float(min(low, mean)), float(max(high, mean)), n, confidence)


def mean_interval(
    scores: Sequence[float],
    *,
    resamples: int = DEFAULT_RESAMPLES,
    confidence: float = DEFAULT_CONFIDENCE,
    seed: int = 0,
) -> Interval:
    """The mean of ``scores`` with a percentile bootstrap interval.

    Raises:
        ValueError: No scores, a non-finite score, or bounds outside their ranges.
    """
    _check(resamples, confidence)
    values = np.asarray(scores, dtype=float)
    if values.size == 0:
        raise ValueError("no scores to summarise; an interval needs at least one item")
    if not np.all(np.isfinite(values)):
        raise ValueError("scores must be finite numbers; a NaN or inf score means a scorer bug upstream")
    return _percentile_interval(values, resamples, confidence, seed)


def paired_difference(
    a: Sequence[float],
    b: Sequence[float],
    *,
    resamples: int = DEFAULT_RESAMPLES,
    confidence: float = DEFAULT_CONFIDENCE,
    seed: int = 0,
) -> Interval:
    """Mean of ``b[i] - a[i]`` with a paired percentile bootstrap interval (items resampled together).

    Raises:
        ValueError: The arms differ in length or are empty.
    """
    if len(a) != len(b):
        raise ValueError(f"paired arms must have one score per item each, got {len(a)} and {len(b)}")
    diffs = np.asarray(b, dtype=float) - np.asarray(a, dtype=float)
    return mean_interval(diffs.tolist(), resamples=resamples, confidence=confidence, seed=seed)
