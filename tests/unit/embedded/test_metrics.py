"""metrics.jsonl lines: every figure through its one definition (spade.signal, the memory, the learner)."""

from __future__ import annotations

from typing import Any

from services.designer.core.attempt import AttemptOutcome, AttemptRecord
from services.designer.core.rounds import BatchResult
from services.embedded.metrics import console_line, env_signal, step_metrics, summary_sentences, why_not_trained
from services.learner.core.window import DesignerAttempt, ScoredAttempt, ScoreOutcome
from services.learner.learner import StepReport
from services.learner.trainer import StepMetrics
from spade import signal
from spade.envs.types import FinishReason
from spade.memory.records import AttemptStats, MemoryStats, Play, PoolMetrics


def _play(
    env: str, seed: int, hinted: bool, ret: float, slot: int = 0, reason: FinishReason = FinishReason.TERMINATED
) -> Play:
    return Play(env, seed, hinted, ret, 2, 0, f"{env}-{seed}-{hinted}-{slot}", reason, window_index=slot)


def _record(outcome: AttemptOutcome, n: int) -> AttemptRecord:
    return AttemptRecord(f"s{n}", "round-1", n, 0, "game", "Optimization", outcome)


PLAYS = [
    *[_play("a", s, False, r) for s, r in [(1, 0.0), (2, 1.0), (3, 0.5), (4, 0.0)]],
    *[_play("a", s, True, r) for s, r in [(1, 1.0), (2, 1.0), (3, 0.5), (4, 0.5)]],
    *[_play("b", s, False, r, slot=1) for s, r in [(5, 1.0), (6, 1.0)]],
    _play("c", 7, False, 0.0, reason=FinishReason.FAULT_MEMORY),
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
    batch = BatchResult("round-1", records, timed_out=False, discarded=1)
    attempt = DesignerAttempt("s3", "env", "game", "Optimization", "round-1", 0, True, 1.0, (), (), ())
    components = signal.designer_blend(0.06, 0.5)
    report = StepReport(
        version=2,
        trained=True,
        metrics=StepMetrics(0.1, 0.0, 0.0, 0.01, 0.02, 1.0, 0.0, 1.5, 12, 300, 200, 300, 1, 2.0, 100.0),
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
    assert record["designer/discarded"] == 1  # generated, never an attempt
    assert record["designer/total/outcome/malformed"] == 2 and record["designer/total/validity_rate"] == 0.25
    assert record["designer/blend_mean"] == components.blend and record["designer/scored"] == 1
    assert record["designer/advantage_nonzero_frac"] == 0.5 and record["agent/advantage_abs_mean"] == 0.8
    assert record["learner/loss"] == 0.1 and record["learner/count/agent_groups"] == 3
    assert record["learner/staleness/agent_mean"] == 0.5 and record["pool/vendi_per_n"] == 0.7
    assert record["time/designer_s"] == 1.5
    line = console_line(record, 3)
    assert "designer wrote 1 valid env(s) in 4 attempts (1 valid, 2 malformed, 1 duplicate)" in line
    assert ", 1 more generated beside them and discarded" in line
    assert "scored 1 designer sample(s)" in line and "50% with a nonzero advantage" in line
    assert line.endswith("weights v2; step 2 s, run 3 s so far")  # the step's own time, then the run's


def _time_of_line(step: int, phases: dict[str, float], elapsed_s: float) -> str:
    record = step_metrics(
        step, spec_id="x", batch=None, plays=[], report=None, stats=None, weight_version=str(step),
        elapsed_s=elapsed_s, phases=phases,
    )  # fmt: skip
    return console_line(record, 3).rsplit("; ", 1)[-1]


def test_a_step_that_waited_for_the_learner_and_the_eval_says_so() -> None:
    """The last step holds the learner's last step (nothing overlaps it) and the held-out eval: its line
    says how much of its time each took, so a longer last step does not read as slower generation."""
    last = {"designer": 47.1, "rollout": 28.4, "learner": 28.4, "stats": 0.0, "eval": 13.7, "learner_train": 24.0}
    assert _time_of_line(3, last, 255.0) == (
        "step 118 s (generating 76 s, the learner 28 s, the held-out eval 14 s), run 255 s so far"
    )
    overlapped = {"designer": 25.0, "rollout": 26.8, "learner": 0.4, "stats": 2.8}
    assert _time_of_line(1, overlapped, 136.0) == "step 55 s, run 136 s so far"


def test_the_summary_says_what_happened_in_words() -> None:
    records = [
        {
            "step": 1,
            "designer/attempts": 4,
            "designer/valid": 0,
            "designer/outcome/malformed": 4,
            "agent/plays": 8,
            "agent/win_rate": 0.2,
            "agent/solved_fraction": 0.1,
            "designer/scored": 0,
            "learner/trained": False,
            "learner/count/agent_groups_zero_variance": 2,
        },
        {
            "step": 2,
            "designer/attempts": 4,
            "designer/valid": 0,
            "designer/outcome/malformed": 3,
            "designer/outcome/smoke": 1,
            "agent/plays": 8,
            "agent/win_rate": 0.3,
            "agent/solved_fraction": 0.2,
            "learner/trained": True,
            "learner/count/agent_groups": 2,
        },
    ]
    text = " ".join(summary_sentences(records, designer_mode="policy", pool_designer=False, seeded=5, static=0))
    assert "wrote no valid environment in 8 attempts (7 malformed, 1 smoke)" in text
    assert "trained in 1 of 2 steps: the agent role in 1, on plays of the seed pool (5 envs) only" in text
    assert "the designer role in 0" in text
    assert "from 0.20 at step 1 to 0.30 at step 2" in text and "No designer sample was scored" in text
    off = " ".join(summary_sentences(records[:1], designer_mode="off", pool_designer=False, seeded=0, static=3))
    assert "designer was off" in off
    # The learner never trained in that one-step run: "trained on" must not appear anywhere.
    assert "trained on" not in off and "never trained in 1 step(s)" in off and "zero variance" in off


def test_trained_on_is_said_only_of_samples_the_learner_trained_on() -> None:
    scored: dict[str, Any] = {"designer/attempts": 2, "designer/valid": 1, "designer/outcome/valid": 1}
    scored |= {"agent/plays": 4, "designer/scored": 2, "designer/advantage_nonzero_frac": 0.5}
    idle = [{"step": 1, **scored, "learner/trained": False}]
    text = " ".join(summary_sentences(idle, designer_mode="policy", pool_designer=False, seeded=3, static=0))
    assert "2 designer sample(s) were scored when their window closed (none trained on)" in text
    assert "The learner never trained" in text
    busy = [{"step": 1, **scored, "learner/trained": True, "learner/count/designer_trained": 2}]
    text = " ".join(summary_sentences(busy, designer_mode="policy", pool_designer=False, seeded=3, static=0))
    assert "(2 trained on)" in text and "the designer role in 1" in text
    assert "nonzero in 1 of 1 scored step(s) (on average 50% of a scored step's samples had a nonzero" in text
    flat = [{"step": 2, **scored, "designer/advantage_nonzero_frac": 0.0, "learner/trained": True}]
    text = " ".join(summary_sentences(busy + flat, designer_mode="policy", pool_designer=False, seeded=3, static=0))
    assert "nonzero in 1 of 2 scored step(s)" in text
    frozen = " ".join(summary_sentences(busy, designer_mode="frozen", pool_designer=False, seeded=3, static=0))
    assert "never trained on" in frozen


def test_a_step_that_trains_nothing_says_why_on_the_console() -> None:
    record = {
        "step": 1,
        "agent/plays": 20,
        "learner/trained": False,
        "learner/count/agent_groups_zero_variance": 5,
        "designer/ran": True,
        "designer/attempts": 4,
        "inference/weight_version": "0",
        "elapsed_s": 1.0,
    }
    line = console_line(record, 3)
    assert "nothing complete was ready" not in line
    assert "learner did not train: 5 agent group(s) had zero variance" in line
    assert "no designer sample was scored this step" in line
    assert "the agent played nothing" in why_not_trained({"agent/plays": 0})
