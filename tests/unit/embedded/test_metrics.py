"""metrics.jsonl lines: every figure through its one definition (spade.signal, the memory, the learner)."""

from __future__ import annotations

from services.designer.core.attempt import AttemptOutcome, AttemptRecord
from services.designer.core.rounds import BatchResult
from services.embedded.metrics import console_line, env_signal, step_metrics, summary_sentences
from services.learner.core.window import DesignerAttempt, ScoredAttempt, ScoreOutcome
from services.learner.learner import StepReport
from services.learner.trainer import StepMetrics
from spade import signal
from spade.memory.records import AttemptStats, MemoryStats, Play, PoolMetrics


def _play(env: str, seed: int, hinted: bool, ret: float, slot: int = 0, reason: str = "terminated") -> Play:
    return Play(env, seed, hinted, ret, 2, 0, f"{env}-{seed}-{hinted}-{slot}", reason, window_index=slot)


def _record(outcome: AttemptOutcome, n: int) -> AttemptRecord:
    return AttemptRecord(f"s{n}", "round-1", n, 0, "game", "Optimization", outcome)


PLAYS = [
    *[_play("a", s, False, r) for s, r in [(1, 0.0), (2, 1.0), (3, 0.5), (4, 0.0)]],
    *[_play("a", s, True, r) for s, r in [(1, 1.0), (2, 1.0), (3, 0.5), (4, 0.5)]],
    *[_play("b", s, False, r, slot=1) for s, r in [(5, 1.0), (6, 1.0)]],
    _play("c", 7, False, 0.0, reason="fault_memory"),
]


def test_agent_figures_are_spade_signal_s() -> None:
    record = step_metrics(
        3, spec_id="abc", batch=None, plays=PLAYS, report=None, stats=None, weight_version="2", elapsed_s=1.0
    )
    unhinted = [p.episode_return for p in PLAYS if not p.hinted]
    hinted = [p.episode_return for p in PLAYS if p.hinted]
    assert record["agent/win_rate"] == signal.win_rate(unhinted)
    assert record["agent/solved_fraction"] == signal.solved_fraction(unhinted)
    assert record["agent/hinted_win_rate"] == signal.win_rate(hinted)
    assert (record["agent/plays"], record["agent/hinted_plays"]) == (7, 4)
    assert record["agent/finish/fault_memory"] == 1 and record["agent/resource_faults"] == 1
    assert record["spec_id"] == "abc" and record["designer/ran"] is False


def test_regret_plateau_and_learnable_whenever_both_arms_exist() -> None:
    figures = env_signal(PLAYS)
    a_hinted = [(p.seed, p.episode_return) for p in PLAYS if p.env_id == "a" and p.hinted]
    a_plain = [(p.seed, p.episode_return) for p in PLAYS if p.env_id == "a" and not p.hinted]
    assert figures["play/regret_mean"] == signal.regret(a_hinted, a_plain) == 0.375
    rates = [0.375, 1.0, 0.0]  # a, b, c unhinted
    assert figures["play/plateau_mean"] == sum(signal.plateau(w) for w in rates) / 3
    assert figures["play/learnable_fraction"] == signal.learnable_fraction(rates)
    mismatched = env_signal([_play("d", 1, False, 0.0), _play("d", 2, True, 1.0)])
    assert mismatched["play/regret_mean"] is None and mismatched["play/regret_mismatched"] == 1


def test_designer_outcomes_learner_and_memory_figures_keep_their_names() -> None:
    records = (
        _record(AttemptOutcome.MALFORMED, 0),
        _record(AttemptOutcome.MALFORMED, 1),
        _record(AttemptOutcome.DUPLICATE, 2),
        _record(AttemptOutcome.VALID, 3),
    )
    batch = BatchResult("round-1", records, timed_out=False)
    attempt = DesignerAttempt("s3", "env", "game", "Optimization", "round-1", 0, True, 1.0, (), (), ())
    components = signal.designer_blend(0.06, 0.5)
    report = StepReport(
        version=2,
        trained=True,
        metrics=StepMetrics(0.1, 0.0, 0.0, 0.01, 0.02, 1.0, 0.0, 1.5, 12, 300, 200, 1, 2.0, 100.0),
        counters={"agent_groups": 3},
        designer_rewards=[ScoredAttempt(attempt, ScoreOutcome.SCORED, components)],
        staleness={"staleness/agent_mean": 0.5},
        advantages={"designer/advantage_nonzero_frac": 0.5, "agent/advantage_abs_mean": 0.8},
    )
    stats = MemoryStats(
        total=3,
        by_status={},
        by_skill={},
        scored=1,
        learnable_fraction=1.0,
        mean_regret=0.1,
        validity_rate=0.25,
        plays=10,
        attempts=AttemptStats(attempts=4, valid=1, validity_rate=0.25, by_outcome={"malformed": 2}),
        pool=PoolMetrics(envs=2, vendi_per_n=0.7, vendi_note=""),
    )
    record = step_metrics(
        1,
        spec_id="x",
        batch=batch,
        plays=[],
        report=report,
        stats=stats,
        weight_version="2",
        elapsed_s=3.0,
        phases={"designer": 1.5},
    )
    assert record["designer/outcome/malformed"] == 2 and record["designer/outcome/valid"] == 1
    assert record["designer/validity_rate"] == 0.25 and record["designer/attempts"] == 4
    assert record["designer/total/outcome/malformed"] == 2 and record["designer/total/validity_rate"] == 0.25
    assert record["designer/blend_mean"] == components.blend and record["designer/scored"] == 1
    assert record["designer/advantage_nonzero_frac"] == 0.5 and record["agent/advantage_abs_mean"] == 0.8
    assert record["learner/loss"] == 0.1 and record["learner/count/agent_groups"] == 3
    assert record["learner/staleness/agent_mean"] == 0.5 and record["pool/vendi_per_n"] == 0.7
    assert record["time/designer_s"] == 1.5
    line = console_line(record, 3)
    assert "designer wrote 1 valid env(s) in 4 attempts (1 valid, 2 malformed, 1 duplicate)" in line
    assert "scored 1 designer sample(s)" in line and "50% with a nonzero advantage" in line


def test_the_summary_says_what_happened_in_words() -> None:
    records = [
        {
            "step": 1,
            "designer/attempts": 4,
            "designer/valid": 0,
            "designer/outcome/malformed": 4,
            "agent/win_rate": 0.2,
            "agent/solved_fraction": 0.1,
            "designer/scored": 0,
        },
        {
            "step": 2,
            "designer/attempts": 4,
            "designer/valid": 0,
            "designer/outcome/malformed": 3,
            "designer/outcome/smoke": 1,
            "agent/win_rate": 0.3,
            "agent/solved_fraction": 0.2,
        },
    ]
    text = " ".join(summary_sentences(records, designer_mode="policy", pool_designer=False, seeded=5, static=0))
    assert "wrote no valid environment in 8 attempts (7 malformed, 1 smoke)" in text
    assert "trained on the seed pool (5 example envs) only" in text
    assert "from 0.20 at step 1 to 0.30 at step 2" in text and "No designer sample was scored" in text
    off = " ".join(summary_sentences(records[:1], designer_mode="off", pool_designer=False, seeded=0, static=3))
    assert "designer was off" in off and "static pool (3 envs)" in off
