"""The reward maths, value by value."""

from __future__ import annotations

import math

import pytest

from services.learner.core.rewards import (
    DesignerRewardConfig,
    MismatchedArmsError,
    PlateauBand,
    RewardError,
    center_by_key,
    designer_reward,
    group_zscores,
    plateau,
    regret,
    validity_fraction,
)


@pytest.mark.parametrize(
    ("w", "expected"),
    [
        (0.0, 0.0),
        (0.1, 0.0),
        (0.15, 0.0),
        (0.2, 0.2),  # (0.2 - 0.15) / 0.25
        (0.275, 0.5),
        (0.4, 1.0),
        (0.5, 1.0),
        (0.6, 1.0),
        (0.7, 0.6),  # (0.85 - 0.7) / 0.25
        (0.85, 0.0),
        (0.9, 0.0),
        (1.0, 0.0),
    ],
)
def test_plateau_values(w, expected):
    assert plateau(w) == pytest.approx(expected, abs=1e-12)


def test_plateau_is_continuous_at_the_band_edges():
    for edge in (0.15, 0.4, 0.6, 0.85):
        assert plateau(edge - 1e-9) == pytest.approx(plateau(edge + 1e-9), abs=1e-6)


def test_plateau_rejects_out_of_range_and_custom_band():
    with pytest.raises(RewardError, match=r"\[0, 1\]"):
        plateau(1.2)
    with pytest.raises(RewardError, match="finite"):
        plateau(math.nan)
    band = PlateauBand(zero_low=0.0, low=0.5, high=0.5, zero_high=1.0)
    assert plateau(0.25, band) == pytest.approx(0.5)
    with pytest.raises(RewardError, match="zero_low < low"):
        PlateauBand(zero_low=0.5, low=0.4)


def test_regret_is_difference_of_means_on_matched_arms():
    hinted = [(1, 1.0), (2, 1.0), (3, 0.0), (4, 1.0)]
    unhinted = [(4, 0.0), (3, 0.0), (2, 1.0), (1, 0.0)]
    assert regret(hinted, unhinted) == pytest.approx(0.75 - 0.25)


def test_regret_can_be_negative():
    assert regret([(7, 0.0)], [(7, 1.0)]) == -1.0


def test_regret_rejects_different_seeds():
    with pytest.raises(MismatchedArmsError, match="same seeds"):
        regret([(1, 1.0), (2, 1.0)], [(1, 0.0), (3, 0.0)])


def test_regret_rejects_different_counts_even_on_the_same_seeds():
    # The reference defect: 16 hinted plays vs 8 unhinted ones.
    with pytest.raises(MismatchedArmsError, match="2 hinted vs 1 unhinted"):
        regret([(1, 1.0), (1, 1.0)], [(1, 0.0)])


def test_regret_rejects_empty_arms_and_nan():
    with pytest.raises(RewardError, match="empty"):
        regret([], [])
    with pytest.raises(RewardError, match="finite"):
        regret([(1, math.nan)], [(1, 0.0)])


def test_designer_reward_blend_with_paper_defaults():
    c = designer_reward(0.075, 0.5, True)
    assert c.regret_norm == pytest.approx(0.5)
    assert c.plateau == 1.0
    assert c.blend == pytest.approx(0.4 * 0.5 + 0.6 * 1.0)


def test_designer_reward_clips_regret_both_ways():
    assert designer_reward(0.9, 0.0, True).blend == pytest.approx(0.4)
    assert designer_reward(-0.5, 0.0, True).blend == 0.0
    assert designer_reward(-0.5, 0.7, True).blend == pytest.approx(0.6 * 0.6)


def test_designer_reward_is_zero_for_invalid_envs_whatever_the_inputs():
    c = designer_reward(1.0, 0.5, False, validity_fraction_value=0.8)
    assert c.blend == 0.0
    assert not c.valid and c.regret is None and c.plateau is None


def test_validity_shaping_is_off_by_default_and_scales_when_on():
    assert DesignerRewardConfig().validity_shaping_weight == 0.0
    cfg = DesignerRewardConfig(validity_shaping_weight=0.1)
    frac = validity_fraction([True, True, True, False])
    assert designer_reward(None, None, False, cfg, frac).blend == pytest.approx(0.075)
    # Shaping never touches valid envs.
    assert designer_reward(0.15, 0.5, True, cfg, frac).blend == pytest.approx(1.0)


def test_designer_reward_config_is_configurable_and_checked():
    cfg = DesignerRewardConfig(regret_weight=1.0, plateau_weight=0.0, regret_scale=0.5)
    assert designer_reward(0.25, 0.0, True, cfg).blend == pytest.approx(0.5)
    with pytest.raises(RewardError, match="regret_scale"):
        DesignerRewardConfig(regret_scale=0.0)
    with pytest.raises(RewardError, match="needs both"):
        designer_reward(None, 0.5, True)


def test_center_by_key_centres_each_skill_without_scaling():
    out = center_by_key([1.0, 0.0, 0.2, 0.4, 0.9], ["math", "math", "logic", "logic", "spatial"])
    assert out == pytest.approx([0.5, -0.5, -0.1, 0.1, 0.0])


def test_group_zscores_and_zero_variance():
    z = group_zscores([1.0, 0.0, 0.0, 1.0])
    assert z == pytest.approx([1.0, -1.0, -1.0, 1.0])
    assert group_zscores([1.0, 1.0, 1.0]) is None
    assert group_zscores([0.3]) is None
    z = group_zscores([0.0, 0.5, 1.0])
    assert z is not None
    assert sum(z) == pytest.approx(0.0)
    assert sum(v * v for v in z) / 3 == pytest.approx(1.0)
