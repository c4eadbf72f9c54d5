"""Bootstrap intervals: exact on constants, seeded, and paired resampling of items."""

from __future__ import annotations

import doctest

import numpy as np
import pytest

from services.eval.core import bootstrap
from services.eval.core.bootstrap import mean_interval, paired_difference


def test_doctests() -> None:
    assert doctest.testmod(bootstrap).failed == 0


def test_a_constant_sample_has_a_zero_width_interval() -> None:
    iv = mean_interval([0.25] * 10, resamples=500)
    assert (iv.mean, iv.low, iv.high, iv.n) == (0.25, 0.25, 0.25, 10)


def test_the_interval_holds_the_mean_and_is_reproducible_for_a_seed() -> None:
    scores = [0.0, 1.0, 1.0, 0.0, 1.0, 0.5, 0.0, 1.0]
    a = mean_interval(scores, resamples=1000, seed=3)
    assert a == mean_interval(scores, resamples=1000, seed=3)
    assert a.mean == pytest.approx(0.5625)
    assert a.low < a.mean < a.high
    assert a.low >= 0.0 and a.high <= 1.0


def test_the_interval_matches_numpy_percentiles_of_resampled_means() -> None:
    scores = np.array([0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.2])
    iv = mean_interval(scores.tolist(), resamples=400, confidence=0.9, seed=11)
    rng = np.random.default_rng(11)
    means = scores[rng.integers(0, 8, size=(400, 8))].mean(axis=1)
    low, high = np.percentile(means, [5.0, 95.0])
    assert (iv.low, iv.high) == pytest.approx((low, high))


def test_a_paired_difference_is_tighter_than_unpaired_intervals_suggest() -> None:
    rng = np.random.default_rng(0)
    difficulty = rng.uniform(0, 1, size=200)
    a = difficulty.tolist()
    b = (difficulty + 0.05).clip(0, 1).tolist()  # the same items, a little better everywhere
    d = paired_difference(a, b, resamples=1000)
    assert d.low > 0.0  # the paired interval excludes zero ...
    ia, ib = mean_interval(a, resamples=1000), mean_interval(b, resamples=1000)
    assert ia.high > ib.low  # ... although the two separate intervals overlap


def test_bad_input_is_refused_with_the_rule() -> None:
    with pytest.raises(ValueError, match="no scores"):
        mean_interval([])
    with pytest.raises(ValueError, match="finite"):
        mean_interval([float("nan")])
    with pytest.raises(ValueError, match="one score per item"):
        paired_difference([1.0], [1.0, 0.0])
    with pytest.raises(ValueError, match="confidence"):
        mean_interval([1.0], confidence=1.5)
