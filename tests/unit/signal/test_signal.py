"""The one definition of each signal quantity (spade/signal.py): rules, edges and errors."""

from __future__ import annotations

import doctest
import math
from dataclasses import dataclass

import pytest

from spade import signal
from spade.signal import (
    DesignerRewardConfig,
    MismatchedArmsError,
    PlateauBand,
    SignalError,
    SkillBaselines,
    chance_corrected,
    designer_advantages,
    designer_blend,
    group_zscores,
    learnable,
    learnable_fraction,
    plateau,
    regret,
    regret_norm,
    solved_fraction,
    win_rate,
)


def test_doctests() -> None:
    failures, tried = doctest.testmod(signal)
    assert tried > 10 and failures == 0


def test_win_rate_is_the_mean_return_not_the_solved_share() -> None:
    returns = [1.0, 0.5, 0.5, 0.0]
    assert win_rate(returns) == 0.5
    assert solved_fraction(returns) == 0.25


@pytest.mark.parametrize("bad", [[], [1.5], [-0.1], [math.nan], [math.inf]])
def test_rates_refuse_what_is_not_a_return(bad: list[float]) -> None:
    with pytest.raises(SignalError):
        win_rate(bad)
    with pytest.raises(SignalError):
        solved_fraction(bad)


def test_learnable_is_the_papers_band_inclusive() -> None:
    assert [learnable(w) for w in (0.19, 0.2, 0.5, 0.8, 0.81)] == [False, True, True, True, False]
    assert learnable_fraction([0.1, 0.5, 0.7, 0.95]) == 0.5
    assert learnable_fraction([]) is None


def test_plateau_shape() -> None:
    assert plateau(0.4) == plateau(0.6) == 1.0
    assert plateau(0.15) == plateau(0.85) == 0.0
    assert plateau(0.0) == plateau(1.0) == 0.0
    assert plateau(0.275) == pytest.approx(0.5)
    assert plateau(0.725) == pytest.approx(0.5)
    with pytest.raises(SignalError):
        plateau(1.2)
    with pytest.raises(SignalError):
        PlateauBand(0.5, 0.4, 0.6, 0.85)


def test_regret_needs_the_same_seeds_the_same_number_of_times() -> None:
    assert regret([(1, 1.0), (2, 0.0)], [(2, 0.0), (1, 0.0)]) == 0.5
    with pytest.raises(MismatchedArmsError, match="same seeds"):
        regret([(1, 1.0), (2, 1.0)], [(1, 0.0), (3, 0.0)])
    with pytest.raises(MismatchedArmsError):
        regret([(1, 1.0), (1, 1.0)], [(1, 0.0)])
    with pytest.raises(SignalError):
        regret([], [(1, 0.0)])


def test_regret_norm_clips_at_the_scale() -> None:
    assert regret_norm(-0.3) == 0.0
    assert regret_norm(0.075) == pytest.approx(0.5)
    assert regret_norm(0.5) == 1.0
    with pytest.raises(SignalError):
        regret_norm(0.1, scale=0.0)


def test_chance_correction_pays_only_what_beats_a_trivial_policy() -> None:
    assert chance_corrected(0.7, 0.0) == 0.7  # no trivial win: the rate as it is
    assert chance_corrected(0.5, 0.5) == 0.0 and chance_corrected(0.3, 0.5) == 0.0  # no better than a constant
    assert chance_corrected(1.0, 0.4) == 1.0 and chance_corrected(0.55, 0.1) == pytest.approx(0.5)
    # A constant payer sits at the plateau's top uncorrected, at 0 corrected, whatever it pays.
    for pays in (0.15, 0.45, 0.5, 0.6):
        assert designer_blend(0.0, pays, trivial_win_rate=pays).blend == 0.0
    for bad in ((1.2, 0.0), (0.5, 1.0), (0.5, -0.1), (float("nan"), 0.0)):
        with pytest.raises(SignalError):
            chance_corrected(*bad)


def test_designer_blend_weights_and_invalid_attempts() -> None:
    c = designer_blend(0.15, 0.5)
    assert (c.regret_norm, c.plateau, c.blend) == (1.0, 1.0, pytest.approx(1.0))
    c = designer_blend(0.0, 0.9)
    assert c.blend == 0.0
    invalid = designer_blend(None, None, valid=False, validity_fraction_value=0.5)
    assert invalid.blend == 0.0 and not invalid.valid
    shaped = designer_blend(None, None, False, DesignerRewardConfig(validity_shaping_weight=0.2), 0.5)
    assert shaped.blend == pytest.approx(-0.1)
    with pytest.raises(SignalError):
        designer_blend(None, 0.5, valid=True)


@pytest.mark.parametrize("weight", [0.0, 0.2, 1.0])
@pytest.mark.parametrize("passed", [0.0, 0.5, 0.8, 0.99])
def test_shaping_never_outbids_validity(weight: float, passed: float) -> None:
    """A round where a nearly-valid attempt meets a valid env the agent cannot win: the valid env ranks higher.

    The valid env's agent scores 0 in both arms (regret 0, window win rate 0: plateau 0, blend 0), the
    smallest reward a valid env can earn; the invalid attempt passed most checks. Before shaping became
    a penalty, 8 of 10 checks at weight 0.2 earned 0.16 and outbid the valid env.
    """
    config = DesignerRewardConfig(validity_shaping_weight=weight)
    valid = designer_blend(0.0, 0.0, True, config)
    invalid = designer_blend(None, None, False, config, passed)
    malformed = designer_blend(None, None, False, config, None)
    assert valid.blend == 0.0
    advantages = designer_advantages(
        [valid.blend, invalid.blend, malformed.blend], ["Logic", "Logic", "Logic"], SkillBaselines()
    )
    if weight == 0.0:  # the paper: every invalid attempt gets 0, a tie with the valid env's floor
        assert invalid.blend == malformed.blend == 0.0
    else:
        assert advantages[0] > advantages[1] >= advantages[2]
        assert (advantages[1] > advantages[2]) == (passed > 0)  # more checks passed, a smaller penalty
        assert invalid.blend == pytest.approx(-weight * (1 - passed)) and malformed.blend == -weight
    # whatever the weight, no invalid attempt earns more than any valid env could
    for regret_value, rate in [(0.0, 0.0), (0.0, 1.0), (-0.5, 0.95), (0.3, 0.5)]:
        assert designer_blend(regret_value, rate, True, config).blend >= invalid.blend


def test_group_zscores() -> None:
    z = group_zscores([1.0, 0.0, 0.5, 0.5])
    assert z is not None and sum(z) == pytest.approx(0.0)
    assert group_zscores([0.3, 0.3, 0.3]) is None


def test_designer_advantages_centre_within_skill_and_fall_back_to_the_running_mean() -> None:
    baselines = SkillBaselines(length=3)
    adv = designer_advantages([0.9, 0.1, 0.6, 0.2], ["a", "a", "b", "b"], baselines)
    assert adv == pytest.approx([0.4, -0.4, 0.2, -0.2])
    # A lone env of skill "a" is centred on a's recent blends (0.9, 0.1), not dropped and not zero.
    assert designer_advantages([0.8], ["a"], baselines) == pytest.approx([0.3])
    # The running mean covers only the last `length` blends: (0.1, 0.8, 0.3) after this round.
    designer_advantages([0.3], ["a"], baselines)
    assert baselines.mean("a") == pytest.approx((0.1 + 0.8 + 0.3) / 3)
    # A skill never seen and alone in its round is centred on the round's mean blend.
    assert designer_advantages([0.7, 0.2, 0.3], ["c", "a", "a"], baselines) == pytest.approx([0.3, -0.05, 0.05])


def test_skill_baselines_round_trip() -> None:
    b = SkillBaselines(length=2)
    b.add("a", [0.1, 0.2, 0.3])
    again = SkillBaselines.from_dict(b.to_dict())
    assert again.mean("a") == pytest.approx(0.25) and again.length == 2
    with pytest.raises(SignalError):
        SkillBaselines(length=0)


@dataclass(frozen=True)
class _Play:
    seed: int
    hinted: bool
    episode_return: float
    window_index: int = 0
    finish_reason: str = "terminated"


def test_the_signal_selects_its_plays_by_slot_and_counts_a_resource_fault_as_zero() -> None:
    plays = [
        _Play(1, True, 1.0),
        _Play(1, False, 0.5),
        _Play(2, True, 1.0, finish_reason="fault_memory"),  # the env failed the agent: counts 0
        _Play(2, False, 0.8, finish_reason="no_such_reason"),  # an unknown reason is no fault
        _Play(3, False, 1.0, window_index=1),  # slot 1: the window, not the regret
        _Play(4, False, 1.0, window_index=2),  # past a window of k = 2
        _Play(5, False, 1.0, window_index=-1),  # no slot: never counted
    ]
    hinted, unhinted = signal.slot0_arms(plays)
    assert hinted == [(1, 1.0), (2, 0.0)] and unhinted == [(1, 0.5), (2, 0.8)]
    assert signal.regret(hinted, unhinted) == pytest.approx(-0.15)
    assert signal.window_returns(plays, 2) == [0.5, 0.8, 1.0]
    assert signal.window_returns(plays, None) == [0.5, 0.8, 1.0, 1.0]
    assert signal.counted_return(plays[2]) == 0.0 and signal.counted_return(plays[3]) == 0.8
