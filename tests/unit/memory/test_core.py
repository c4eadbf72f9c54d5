"""The memory's pure core: normalisation, scoring and the example policy."""

from __future__ import annotations

import pytest

from services.memory.core.normalise import code_hash, normalise_code
from services.memory.core.policy import PolicyConfig, choose, excerpt, with_code
from services.memory.core.scoring import score, shape
from spade import signal
from spade.envs.types import FinishReason
from spade.memory.records import Candidate, Examples, Play


def env(seq: int, win_rate: float | None, regret: float | None = 0.0, skill: str = "Optimization") -> Candidate:
    return Candidate(env_id=f"e{seq}", seq=seq, skill=skill, win_rate=win_rate, regret=regret, window_plays=8)


def code_of(seq: int) -> str:
    return f"import random\n\nclass Env{seq}:\n" + "".join(f"    x{i} = {i}\n" for i in range(200))


def select_examples(
    window: list[Candidate], n_positive: int, n_negative: int, seed: int, config: PolicyConfig
) -> Examples:
    picks = choose(window, n_positive, n_negative, seed, config)
    return with_code(picks, {i: code_of(int(i[1:])) for i in picks.env_ids()}, config)


# -- normalisation ------------------------------------------------------------------------------


def test_normalisation_ignores_comments_docstrings_and_layout() -> None:
    a = 'class AEnv:\n    """Doc."""\n    def step(self, a):  # act\n        return (a,\n  1)\n'
    b = "class AEnv:\n\n    def step(self, a):\n        '''Other doc.'''\n        return (a, 1)\n"
    b2 = "class AEnv:\n    def step(self, a):\n        return (a, 1)\n"
    assert code_hash(a) == code_hash(b2) == code_hash(b)
    assert code_hash(b2) != code_hash(b2.replace("1)", "2)"))


def test_string_constants_that_are_not_docstrings_matter() -> None:
    a = "class E:\n    x = 1\n    'not a docstring'\n"
    assert code_hash(a) != code_hash("class E:\n    x = 1\n")


def test_unparsable_code_still_normalises() -> None:
    broken = "class E(:\n    # note\n\n    x = 1   \n"
    assert normalise_code(broken) == "class E(:\n    x = 1"
    assert code_hash(broken) == code_hash("class E(:\n    x = 1\n")


# -- scoring ------------------------------------------------------------------------------------


def play(
    seed: int,
    hinted: bool,
    ret: float,
    slot: int = 0,
    i: int = 0,
    version: int = 0,
    finish: FinishReason = FinishReason.TERMINATED,
) -> Play:
    return Play("e", seed, hinted, ret, 2, version, f"{seed}-{hinted}-{slot}-{i}", finish, window_index=slot)


def test_regret_is_slot_zeros_arms_on_the_same_seeds() -> None:
    plays = [play(1, False, 0.0), play(1, True, 1.0), play(2, False, 0.5), play(2, True, 1.0)]
    plays.append(play(3, True, 0.0, slot=1))  # a hinted play outside slot 0 is not regret's
    st = score(plays, window_versions=4)
    assert st.regret == pytest.approx(signal.regret([(1, 1.0), (2, 1.0)], [(1, 0.0), (2, 0.5)]))
    assert st.regret == pytest.approx(0.75) and st.regret_note == ""


def test_mismatched_arms_store_no_regret_and_say_why() -> None:
    seeds_differ = [play(1, False, 0.0), play(1, True, 1.0), play(2, True, 1.0), play(3, False, 0.0)]
    st = score(seeds_differ, window_versions=4)
    assert st.regret is None and "same seeds" in st.regret_note and "[2]" in st.regret_note
    counts_differ = [play(1, False, 0.0), play(1, True, 1.0, i=0), play(1, True, 1.0, i=1)]
    st = score(counts_differ, window_versions=4)
    assert st.regret is None and "2 hinted vs 1 unhinted" in st.regret_note
    one_arm = score([play(1, True, 1.0)], window_versions=4)
    assert one_arm.regret is None and "1 hinted and 0 unhinted" in one_arm.regret_note
    assert score([], window_versions=4).regret_note == ""


def test_slots_not_generating_versions_decide() -> None:
    # The learner published between design and play: slot 0 was played by versions 7 and 8.
    plays = [play(1, False, 0.0, version=7), play(1, True, 1.0, version=8), play(2, False, 1.0, slot=1, version=9)]
    st = score(plays, window_versions=2)
    assert st.regret == pytest.approx(1.0)
    assert (st.window_plays, st.win_rate) == (2, 0.5)


def test_win_rate_is_the_mean_return_over_the_window_slots() -> None:
    plays = [play(1, False, 0.5), play(2, False, 1.0, slot=1), play(3, False, 0.0, slot=2), play(4, True, 1.0)]
    st = score(plays, window_versions=2)  # slots 0 and 1; the hinted play is no window play
    assert (st.window_plays, st.win_rate, st.solved_fraction) == (2, 0.75, 0.5)
    assert score(plays, window_versions=None).window_plays == 3  # no window known: every slot


def test_a_resource_fault_counts_as_return_zero() -> None:
    plays = [
        play(1, False, 1.0),
        play(2, False, 1.0, finish=FinishReason.FAULT_MEMORY),
        play(3, False, 1.0, finish=FinishReason.TRUNCATED),
    ]
    st = score(plays, window_versions=4)
    assert st.win_rate == pytest.approx(2 / 3) and st.window_plays == 3
    assert shape(plays).reward_levels == 1  # a fault emits no reward level
    fault = FinishReason.names_resource_fault
    assert fault("fault_cpu") and not fault("turn_limit") and not fault("")


def test_learnable_is_the_signal_band() -> None:
    def rate(r: float) -> bool:
        return score([play(1, False, r)], window_versions=1).learnable

    assert [rate(x) for x in (0.19, 0.2, 0.5, 0.8, 0.81)] == [False, True, True, True, False]
    assert signal.LEARNABLE_BAND == (0.2, 0.8)
    assert not score([play(1, True, 1.0)], window_versions=1).learnable  # unscored


def test_shape_counts_reward_levels_and_turns() -> None:
    plays = [play(1, False, 0.0), play(2, False, 0.5), play(3, False, 0.5), play(4, True, 1.0)]
    sh = shape(plays)
    assert sh.reward_levels == 3 and sh.turns_mean == 2.0
    assert shape([]).turns_mean is None


# -- policy -------------------------------------------------------------------------------------


def test_positives_are_learnable_and_ranked_by_regret() -> None:
    window = [env(1, 0.2, 0.2), env(2, 0.8, 0.9), env(3, 0.5, 0.5), env(4, 0.81, 1.0), env(5, 0.19, 1.0)]
    ex = select_examples(window, n_positive=3, n_negative=0, seed=0, config=PolicyConfig())
    assert [e.env_id for e in ex.positives] == ["e2", "e3", "e1"]  # band edges included, outside excluded
    assert ex.positives[0].reason == "learnable: win rate 0.80, regret 0.90"
    assert all(signal.learnable(e.win_rate) for e in ex.positives)  # the learner's definition


def test_positive_draw_comes_from_the_top_regret_pool_and_is_seeded() -> None:
    window = [env(i, 0.5, regret=i / 100) for i in range(1, 41)]
    top10 = {f"e{i}" for i in range(31, 41)}
    draws = set()
    for seed in range(20):
        ex = select_examples(window, 2, 0, seed, PolicyConfig())
        ids = [e.env_id for e in ex.positives]
        assert set(ids) <= top10, "drew outside the top max(3n, 10) by regret"
        assert ex.positives[0].regret >= ex.positives[1].regret  # type: ignore[operator]
        assert ids == [e.env_id for e in select_examples(window, 2, 0, seed, PolicyConfig()).positives]
        draws.add(tuple(ids))
    assert len(draws) > 1, "the seed did not change the draw"


def test_negatives_carry_code_and_reason_and_mix_both_failure_modes() -> None:
    window = [env(1, 0.95), env(2, 0.97), env(3, 0.05), env(4, 0.8), env(5, 0.2), env(6, 0.5)]
    ex = select_examples(window, 0, 2, seed=3, config=PolicyConfig(excerpt_chars=300))
    reasons = sorted(e.reason.split(":")[0] for e in ex.negatives)
    assert reasons == ["too easy", "too hard"]
    hard = next(e for e in ex.negatives if e.reason.startswith("too hard"))
    assert hard.env_id == "e3" and "win rate 0.05 over 8 plays" in hard.reason
    assert hard.code.startswith("class Env3:") and "x0 = 0" in hard.code  # the code, not just a name
    assert len(hard.code) <= 300 and hard.code.endswith("# ... (truncated)")
    everything = select_examples(window, 0, 10, seed=3, config=PolicyConfig())
    assert {e.env_id for e in everything.negatives} == {"e1", "e2", "e3"}  # 0.8 and 0.2 are learnable


def test_only_the_most_recent_window_counts_and_unscored_are_ignored() -> None:
    window = [env(1, 0.5, regret=0.99), *(env(i, 0.5, 0.1) for i in range(2, 6)), env(9, None)]
    ex = select_examples(window, 5, 5, 0, PolicyConfig(window=4))
    assert {e.env_id for e in ex.positives} == {"e2", "e3", "e4", "e5"}


def test_policy_config_and_counts_are_checked() -> None:
    with pytest.raises(ValueError, match="excerpt_chars"):
        PolicyConfig(excerpt_chars=10)
    with pytest.raises(ValueError, match=">= 0"):
        select_examples([], -1, 0, 0, PolicyConfig())


def test_excerpt_cuts_at_a_line() -> None:
    code = "class A:\n" + "    y = 1\n" * 100
    out = excerpt(code, 100)
    assert len(out) <= 100 and all(line.startswith(("class", "    ")) for line in out.splitlines())
