"""The delayed designer window and the advantages of both roles."""

from __future__ import annotations

import json

import pytest

from services.learner.core.batching import (
    AgentPlaySample,
    BatchError,
    Role,
    TrainSample,
    agent_advantages,
    designer_advantages,
    normalize_per_role,
    pack_by_tokens,
    pad_by_tokens,
)
from services.learner.core.rewards import DesignerRewardConfig
from services.learner.core.window import DesignerAttempt, DesignerWindow, Play, ScoreOutcome


def attempt(sid="d1", env="e1", version=3, valid=True, skill="math", batch="b1", frac=1.0):
    return DesignerAttempt(
        sample_id=sid,
        env_id=env if valid else "",
        setting="game",
        skill=skill,
        batch_id=batch,
        weight_version=version,
        valid=valid,
        validity_fraction=frac,
        prompt_ids=(1, 2, 3),
        output_ids=(4, 5),
        output_logprobs=(-0.5, -0.25),
    )


def play(sid, env="e1", seed=0, hinted=False, version=3, ret=0.0):
    return Play(sid, env, seed, hinted, version, ret)


def fill_window(window, env="e1", first=3, k=2):
    # First version: 4 seeds in each arm; hint helps on two of them.
    for seed, (h, u) in enumerate([(1.0, 0.0), (1.0, 1.0), (1.0, 0.0), (0.0, 0.0)]):
        window.record_play(play(f"{env}h{seed}", env, seed, True, first, h))
        window.record_play(play(f"{env}u{seed}", env, seed, False, first, u))
    # Later version of the window: fresh seeds, unhinted only.
    for seed, r in zip(range(10, 14), [1.0, 1.0, 0.0, 1.0], strict=True):
        window.record_play(play(f"{env}v{seed}", env, seed, False, first + 1, r))
    # A play after the window closed must not count.
    window.record_play(play(f"{env}late", env, 99, False, first + k, 1.0))


def test_attempt_waits_for_k_versions_then_scores_regret_and_window_win_rate():
    w = DesignerWindow(k=2)
    w.add_attempt(attempt())
    fill_window(w)
    assert w.due(3) == [] and w.due(4) == []
    (scored,) = w.due(5)
    assert scored.outcome is ScoreOutcome.SCORED
    c = scored.components
    assert c is not None
    assert c.regret == pytest.approx(0.75 - 0.25)
    assert c.window_win_rate == pytest.approx(4 / 8)  # 1+0+1+0 at v3, 1+1+0+1 at v4
    assert c.blend == pytest.approx(0.4 * 1.0 + 0.6 * 1.0)
    assert w.pending == {} and "e1" not in w.plays  # released once scored


def test_duplicate_deliveries_are_counted_once():
    w = DesignerWindow(k=1)
    assert w.record_play(play("p", ret=1.0))
    assert not w.record_play(play("p", ret=1.0))
    assert w.add_attempt(attempt())
    assert not w.add_attempt(attempt())


def test_invalid_attempts_score_zero_or_shaped():
    w = DesignerWindow(k=1, config=DesignerRewardConfig(validity_shaping_weight=0.2))
    w.add_attempt(attempt("bad", valid=False, frac=0.5))
    (s,) = w.due(4)
    assert s.outcome is ScoreOutcome.INVALID
    assert s.components is not None and s.components.blend == pytest.approx(0.1)


def test_mismatched_arms_make_the_attempt_unscorable_not_silently_scored():
    w = DesignerWindow(k=1)
    w.add_attempt(attempt())
    w.record_play(play("h", seed=1, hinted=True, ret=1.0))
    w.record_play(play("u", seed=2, hinted=False, ret=0.0))
    (s,) = w.due(4)
    assert s.outcome is ScoreOutcome.UNSCORABLE and s.components is None
    assert "same seeds" in s.reason


def test_unplayed_env_is_unscorable():
    w = DesignerWindow(k=1)
    w.add_attempt(attempt())
    (s,) = w.due(10)
    assert s.outcome is ScoreOutcome.UNSCORABLE and "no unhinted plays" in s.reason


def test_state_round_trips_through_json_and_resumes_identically():
    w = DesignerWindow(k=2)
    w.add_attempt(attempt())
    w.add_attempt(attempt("d2", env="e2", skill="logic"))
    fill_window(w)
    fill_window(w, env="e2")
    restored = DesignerWindow.from_json(json.loads(json.dumps(w.to_json())), DesignerRewardConfig())
    assert restored.to_json() == w.to_json()
    assert [s.components for s in restored.due(5)] == [s.components for s in w.due(5)]


def test_prune_drops_only_orphan_accumulators():
    w = DesignerWindow(k=2)
    w.add_attempt(attempt(env="kept"))
    w.record_play(play("a", env="kept", version=0))
    w.record_play(play("b", env="orphan", version=0))
    w.record_play(play("c", env="recent", version=9))
    assert w.prune(learner_version=10, keep_versions=4) == 1
    assert set(w.plays) == {"kept", "recent"}


def sample(sid, adv=0.0, role=Role.AGENT, n=4):
    return TrainSample(sid, role, tuple(range(n)), (0.0,) * n, (False,) + (True,) * (n - 1), 0, adv)


def test_agent_advantages_zscore_per_group_and_drop_zero_variance():
    plays = [
        AgentPlaySample(sample("a1"), "g1", 1.0),
        AgentPlaySample(sample("a2"), "g1", 0.0),
        AgentPlaySample(sample("b1"), "g2", 0.5),
        AgentPlaySample(sample("b2"), "g2", 0.5),
    ]
    out, kept, dropped = agent_advantages(plays)
    assert (kept, dropped) == (1, 1)
    assert {s.sample_id: s.advantage for s in out} == pytest.approx({"a1": 1.0, "a2": -1.0})


def test_designer_advantages_centre_per_skill_within_batch():
    w = DesignerWindow(k=1)
    # Two math envs in batch b1 with different blends, one lone logic env (zero variance).
    w.add_attempt(attempt("m1", env="m1"))
    w.add_attempt(attempt("m2", env="m2"))
    w.add_attempt(attempt("l1", env="l1", skill="logic"))
    for env, u in (("m1", 0.0), ("m2", 1.0), ("l1", 0.5)):
        w.record_play(play(f"{env}h", env, 1, True, 3, 1.0))
        w.record_play(play(f"{env}u", env, 1, False, 3, u))
    scored = w.due(4)
    out, kept, dropped = designer_advantages(scored)
    assert (kept, dropped) == (1, 1)
    blends = {s.attempt.sample_id: s.components.blend for s in scored if s.components}
    mean = (blends["m1"] + blends["m2"]) / 2
    adv = {s.sample_id: s.advantage for s in out}
    assert adv == pytest.approx({"m1": blends["m1"] - mean, "m2": blends["m2"] - mean})
    m1 = next(s for s in out if s.sample_id == "m1")
    assert m1.role is Role.DESIGNER
    assert m1.token_ids == (1, 2, 3, 4, 5) and m1.loss_mask == (False, False, False, True, True)
    assert m1.rollout_logprobs == (0.0, 0.0, 0.0, -0.5, -0.25)


def test_normalize_per_role_scales_each_role_to_unit_std():
    samples = [sample("a", 2.0), sample("b", -2.0), sample("c", 0.1, Role.DESIGNER), sample("d", -0.1, Role.DESIGNER)]
    out = normalize_per_role(samples)
    assert [s.advantage for s in out] == pytest.approx([1.0, -1.0, 1.0, -1.0])


def test_train_sample_rejects_bad_shapes():
    with pytest.raises(BatchError, match="first token"):
        TrainSample("x", Role.AGENT, (1, 2), (0.0, 0.0), (True, True), 0)
    with pytest.raises(BatchError, match="one entry per token"):
        TrainSample("x", Role.AGENT, (1, 2), (0.0,), (False, True), 0)


def test_pack_by_tokens_respects_the_budget():
    lengths = [5, 3, 9, 2, 2, 7, 1]
    bins = pack_by_tokens(lengths, 10)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    for b in bins:  # packed micro-batches cost their total length, not count × longest
        assert len(b) == 1 or sum(lengths[i] for i in b) <= 10
    assert len(bins) == 3  # 29 tokens in bins of 10: first-fit decreasing needs only 3
    assert pack_by_tokens([20, 3], 10) == [[0], [1]]


def test_pad_by_tokens_respects_the_padded_budget():
    lengths = [5, 3, 9, 2, 2, 7, 1]
    bins = pad_by_tokens(lengths, 10)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    for b in bins:
        assert len(b) == 1 or max(lengths[i] for i in b) * len(b) <= 10


def test_incomplete_windows_wait_for_late_plays_up_to_the_grace():
    w = DesignerWindow(k=2, group_size=4, grace=2)
    w.add_attempt(attempt(version=3))
    for seed in range(4):
        w.record_play(play(f"h{seed}", seed=seed, hinted=True, version=3, ret=1.0))
        w.record_play(play(f"u{seed}", seed=seed, version=3, ret=0.0))
    assert not w.has_due(5) and w.due(5) == []  # version 4's plays have not arrived
    for seed in range(10, 13):
        w.record_play(play(f"v{seed}", seed=seed, version=4, ret=1.0))
    assert not w.has_due(6)  # 3 of 4 plays: still incomplete
    w.record_play(play("v13", seed=13, version=4, ret=1.0))
    assert w.has_due(5)
    (s,) = w.due(5)
    assert s.components is not None and s.components.window_win_rate == pytest.approx(0.5)


def test_after_the_grace_an_incomplete_window_is_scored_with_what_arrived():
    w = DesignerWindow(k=2, group_size=4, grace=2)
    w.add_attempt(attempt(version=0))
    w.add_attempt(attempt("bad", valid=False, version=0))
    w.add_attempt(attempt("alone", valid=False, version=0, batch="b2"))
    w.record_play(play("h", seed=1, hinted=True, version=0, ret=1.0))
    w.record_play(play("u", seed=1, version=0, ret=0.0))
    # Invalid attempts need no plays, but wait for the rest of their batch.
    assert [s.attempt.sample_id for s in w.due(2)] == ["alone"]
    assert w.due(3) == []
    s, bad = w.due(4)
    assert bad.attempt.sample_id == "bad" and bad.outcome is ScoreOutcome.INVALID
    assert s.outcome is ScoreOutcome.SCORED and s.components is not None
    assert s.components.window_win_rate == 0.0
