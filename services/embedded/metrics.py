"""One line of ``metrics.jsonl`` per step, the console's line in words, and the run's summary.

Every quantity comes from its one definition: win rate, solved fraction, regret, plateau and
learnable from ``spade.signal``; the pool's process metrics and the designer's totals from the
memory's ``stats()`` (which uses ``spade.pool_metrics``); advantages, staleness and counts from the
learner's step report. This module only names and groups them:

- ``step``, ``elapsed_s``, ``spec_id``, ``time/<phase>_s`` (where the step's wall time went, in
  seconds: the loop's phases (:data:`WALL_PHASES`, which add up to it), each component's busy
  time, and the inference server's own busy, prefill and decode time during the step's generation
  (designer and rollout phases),
  ``time/inference_{busy,prefill,decode}_s``, which overlapping requests do not add up) and
  ``work/<component>_calls`` and ``work/<component>_tokens`` (how many calls each component served,
  tokens it generated), and the server's own token counts during that generation,
  ``work/inference_{generated,prompt,cached}_tokens`` (tokens it generated, prompt tokens its
  prefills computed, prompt tokens its prefix cache supplied), ``work/inference_prefills`` in
  ``work/inference_prefill_passes`` forward passes, and ``work/inference_decode_steps`` over
  ``work/inference_decode_rows`` sequences (their ratio: the mean decode batch). With the learner overlapped
  (``overlap_learner``), ``time/learner_s`` is what the loop waited for the learner,
  ``time/learner_overlapped_s`` the part of its step that ran beside the next step's generation
  (outside the step's wall time) and
  ``time/learner_publish_held_s`` how long its publication was held until that generation was done
  (inside ``learner/time/publish_s``);
- ``designer/...``: this step's round (``designer/attempts``, ``designer/valid``,
  ``designer/validity_rate``, ``designer/outcome/<outcome>`` for valid, malformed, duplicate and
  each failing check), the learner's scored rewards (``designer/regret_mean``, ``designer/blend_mean``
  ...) and advantages (``designer/advantage_nonzero_frac``, ``designer/advantage_abs_mean``);
  ``designer/total/...`` are the memory's figures over every attempt so far;
- ``agent/...``: this step's plays — ``agent/win_rate`` (mean return, unhinted) beside
  ``agent/solved_fraction``, the same for the hinted arm, ``agent/finish/<reason>`` and
  ``agent/resource_faults``, ``agent/advantage_abs_mean``;
- ``play/...``: per env played this step in both arms of its slot 0, ``play/regret_mean`` (spade.signal
  regret), ``play/plateau_mean`` and ``play/learnable_fraction`` of the unhinted win rates;
- ``pool/...`` and ``memory/...``: the memory's stats; ``learner/...``: the trainer's figures, counts,
  staleness and the learner's own step parts (``learner/time/<part>_s``, inside the ``learner``
  phase when it is not overlapped); ``eval/...``: the in-run evaluation, when it ran this step.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from spade import signal
from spade.envs.types import FinishReason

if TYPE_CHECKING:
    from services.designer.core.rounds import BatchResult
    from services.learner.learner import StepReport
    from spade.memory.records import MemoryStats, Play


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def play_metrics(plays: Sequence[Play]) -> dict[str, Any]:
    """The agent's figures of one step's plays (see the module docstring)."""
    unhinted = [signal.counted_return(p) for p in plays if not p.hinted]
    hinted = [signal.counted_return(p) for p in plays if p.hinted]
    record: dict[str, Any] = {
        "agent/plays": len(unhinted),
        "agent/hinted_plays": len(hinted),
        "agent/win_rate": signal.win_rate(unhinted) if unhinted else None,
        "agent/solved_fraction": signal.solved_fraction(unhinted) if unhinted else None,
        "agent/hinted_win_rate": signal.win_rate(hinted) if hinted else None,
        "agent/hinted_solved_fraction": signal.solved_fraction(hinted) if hinted else None,
    }
    reasons = Counter(p.finish_reason or "unknown" for p in plays)
    record.update({f"agent/finish/{reason}": n for reason, n in sorted(reasons.items())})
    faults = (n for reason, n in reasons.items() if FinishReason.names_resource_fault(reason))
    record["agent/resource_faults"] = sum(faults)
    record.update(env_signal(plays))
    return record


def env_signal(plays: Sequence[Play]) -> dict[str, Any]:
    """Regret, plateau and learnable over the envs this step played in both arms of slot 0.

    Regret is ``spade.signal.regret`` of each env's slot-0 arms (an env whose arms do not match is
    counted in ``play/regret_mismatched`` and left out, never given a lenient number); plateau and
    learnable use each env's unhinted win rate over its plays of this step.
    """
    by_env: dict[str, list[Play]] = defaultdict(list)
    for p in plays:
        by_env[p.env_id].append(p)
    regrets: list[float] = []
    mismatched = 0
    rates: list[float] = []
    for mine in by_env.values():
        hinted, unhinted = signal.slot0_arms(mine)
        if hinted and unhinted:
            try:
                regrets.append(signal.regret(hinted, unhinted))
            except signal.MismatchedArmsError:
                mismatched += 1
        returns = signal.window_returns(mine, None)  # every slot this step played
        if returns:
            rates.append(signal.win_rate(returns))
    envs = sum(1 for mine in by_env.values() if any(not p.hinted for p in mine))
    return {
        "play/envs": envs,
        "play/regret_envs": len(regrets),
        "play/regret_mismatched": mismatched,
        "play/regret_mean": _mean(regrets),
        "play/plateau_mean": _mean([signal.plateau(w) for w in rates]),
        "play/learnable_fraction": signal.learnable_fraction(rates),
    }


def designer_metrics(batch: BatchResult | None) -> dict[str, Any]:
    """This step's designer round: attempts, valid envs, each outcome's count, and the generations
    discarded unfinished (generated beside an attempt that filled their slot)."""
    if batch is None:
        return {"designer/ran": False}
    record: dict[str, Any] = {
        "designer/ran": True,
        "designer/round": batch.batch_id,
        "designer/attempts": len(batch.records),
        "designer/valid": len(batch.env_ids),
        "designer/validity_rate": batch.validity_rate if batch.records else None,
        "designer/discarded": batch.discarded,
    }
    record.update({f"designer/outcome/{label}": n for label, n in sorted(batch.outcomes.items())})
    return record


def learner_metrics(report: StepReport | None) -> dict[str, Any]:
    """The learner's step: designer rewards and advantages under their own names, the rest under ``learner/``."""
    if report is None:
        return {"learner/trained": False}
    record: dict[str, Any] = {"learner/trained": report.trained, "learner/version": report.version}
    scored = [s for s in report.designer_rewards if s.components is not None]
    record["designer/scored"] = len(scored)
    record["designer/unscored"] = len(report.designer_rewards) - len(scored)
    for key, value in report.flat_metrics().items():
        if key == "version":
            continue
        record[key if key.startswith(("designer/", "agent/")) else f"learner/{key}"] = value
    return record


def memory_metrics(stats: MemoryStats | None) -> dict[str, Any]:
    """The memory's figures: the pool's process metrics (``pool/...``) and the designer's totals."""
    if stats is None:
        return {}
    record: dict[str, Any] = {}
    for key, value in stats.metrics().items():
        name = "designer/total/" + key.removeprefix("designer/") if key.startswith("designer/") else key
        record[name] = value
    record["pool/learnable_fraction_all"] = stats.learnable_fraction
    record["pool/vendi_note"] = stats.pool.vendi_note
    return record


def step_metrics(
    step: int,
    *,
    spec_id: str,
    batch: BatchResult | None,
    plays: Sequence[Play],
    report: StepReport | None,
    stats: MemoryStats | None,
    weight_version: str,
    elapsed_s: float,
    phases: Mapping[str, float] | None = None,
    counts: Mapping[str, int] | None = None,
    evaluation: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """One line of ``metrics.jsonl`` (see the module docstring for the names)."""
    record: dict[str, Any] = {"step": step, "elapsed_s": round(elapsed_s, 1), "spec_id": spec_id}
    record.update({f"time/{phase}_s": round(seconds, 3) for phase, seconds in (phases or {}).items()})
    record.update({f"work/{name}": count for name, count in (counts or {}).items()})
    record.update(designer_metrics(batch))
    record.update(play_metrics(plays))
    record.update(learner_metrics(report))
    record.update(memory_metrics(stats))
    record.update(evaluation or {})
    record["inference/weight_version"] = weight_version
    return {k: _json_number(v) for k, v in record.items()}


def _json_number(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


# --- words -------------------------------------------------------------------------------------------


def _pct(value: Any) -> str:
    return "–" if value is None else f"{100 * value:.0f}%"


def _num(value: Any, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def outcome_words(record: Mapping[str, Any]) -> str:
    """``"1 valid, 3 malformed"`` from a record's ``designer/outcome/...`` counts."""
    parts = [
        (key.removeprefix("designer/outcome/"), n)
        for key, n in record.items()
        if key.startswith("designer/outcome/") and n
    ]
    parts.sort(key=lambda kv: (kv[0] != "valid", -kv[1], kv[0]))
    return ", ".join(f"{n} {label}" for label, n in parts) or "no attempt finished"


def console_line(record: Mapping[str, Any], steps: int) -> str:
    """The step in words (the console prints it after each step)."""
    if record.get("designer/ran"):
        designer = (
            f"designer wrote {record.get('designer/valid', 0)} valid env(s) in {record.get('designer/attempts', 0)} "
            f"attempts ({outcome_words(record)})"
        )
        if record.get("designer/discarded"):
            designer += f", {record['designer/discarded']} more generated beside them and discarded"
    else:
        designer = "no designer round"
    plays = record.get("agent/plays", 0)
    agent = (
        f"agent played {plays} times: mean return {_num(record.get('agent/win_rate'))}, "
        f"solved {_pct(record.get('agent/solved_fraction'))}"
        if plays
        else "agent played nothing"
    )
    if record.get("agent/hinted_plays"):
        agent += f" (with hint: {_num(record.get('agent/hinted_win_rate'))})"
    faults = record.get("agent/resource_faults") or 0
    if faults:
        agent += f", {faults} ended in a resource fault"
    if record.get("learner/trained"):
        learner = f"learner trained on {int(record.get('learner/samples') or 0)} samples"
        scored = record.get("designer/scored") or 0
        if scored:
            learner += (
                f", scored {scored} designer sample(s) (mean blend {_num(record.get('designer/blend_mean'))}, "
                f"{_pct(record.get('designer/advantage_nonzero_frac'))} with a nonzero advantage)"
            )
    else:
        learner = f"learner did not train: {record.get('learner/why_not_trained') or why_not_trained(record)}"
    return (
        f"step {record['step']}/{steps}: {designer}; {agent}; {learner}; "
        f"weights v{record.get('inference/weight_version')}; {_seconds(record)}"
    )


WALL_PHASES = ("designer", "rollout", "learner", "stats", "eval")
"""The loop's phases, one after another: a step's wall time is the sum of their ``time/<phase>_s``
(every other ``time/`` figure ran inside or beside them: busy times, the overlapped learner)."""


def _seconds(record: Mapping[str, Any]) -> str:
    """The step's own wall time beside the run's so far (the latter alone read as the step's), and what
    beyond generation it waited for, when it waited for something: the learner (the last step's, which
    nothing overlaps, or a sequential run's) and the held-out evaluation."""

    def took(phase: str) -> float:
        return float(record.get(f"time/{phase}_s") or 0.0)

    step_s = sum(took(phase) for phase in WALL_PHASES)
    shown = [f"the learner {took('learner'):.0f} s"] if took("learner") >= 1.0 else []
    shown += [f"the held-out eval {took('eval'):.0f} s"] if took("eval") > 0.0 else []
    detail = f" (generating {took('designer') + took('rollout'):.0f} s, {', '.join(shown)})" if shown else ""
    return f"step {step_s:.0f} s{detail}, run {float(record.get('elapsed_s') or 0.0):.0f} s so far"


def _count(record: Mapping[str, Any], name: str) -> int:
    return int(record.get(f"learner/count/{name}") or 0)


def why_not_trained(record: Mapping[str, Any]) -> str:
    """Why a step's learner did not train, in words, from the step's line of ``metrics.jsonl``.

    >>> why_not_trained({"agent/plays": 8, "learner/count/agent_groups_zero_variance": 2})[:40]
    '2 agent group(s) had zero variance (ever'
    """
    reasons = []
    plays = int(record.get("agent/plays") or 0)
    if not plays:
        reasons.append("the agent played nothing (no env was due)")
    zero = _count(record, "agent_groups_zero_variance")
    if zero:
        reasons.append(
            f"{zero} agent group(s) had zero variance (every play of a group the same return: nothing to compare)"
        )
    stale = _count(record, "stale_groups_dropped")
    if stale:
        reasons.append(f"{stale} agent group(s) were too stale")
    if plays and not zero and not stale and not _count(record, "agent_groups"):
        reasons.append("no agent group was complete")
    faults = _count(record, "resource_fault_dropped")
    if faults:
        reasons.append(f"{faults} play(s) ended in a resource fault and were dropped")
    scored = int(record.get("designer/scored") or 0)
    if scored:
        reasons.append(f"the {scored} scored designer sample(s) all had a zero advantage (equal blends)")
    elif record.get("designer/ran"):
        reasons.append("no designer sample was scored this step")
    else:
        reasons.append("no designer round")
    return "; ".join(reasons)


def held_out_sentence(held_out: Mapping[str, float]) -> str:
    """The held-out evaluation's paired difference in words (the report's first line).

    >>> held_out_sentence({"mean": 0.05, "low": -0.01, "high": 0.12, "n": 12, "before": 0.3, "after": 0.35})[-65:]
    '[-0.010, +0.120], which includes 0: no change shown at this size.'
    """
    mean, low, high = held_out["mean"], held_out["low"], held_out["high"]
    verdict = (
        "which includes 0: no change shown at this size"
        if low <= 0.0 <= high
        else ("above 0: the agent improved" if low > 0 else "below 0: the agent got worse")
    )
    return (
        f"On held-out envs ({int(held_out['n'])} paired items) the mean return went from {held_out['before']:.3f} "
        f"before the first step to {held_out['after']:.3f} after the last: a paired difference of {mean:+.3f}, "
        f"95% bootstrap interval [{low:+.3f}, {high:+.3f}], {verdict}."
    )


def summary_sentences(
    records: Sequence[Mapping[str, Any]], *, designer_mode: str, pool_designer: bool, seeded: int, static: int
) -> list[str]:
    """What happened in the run, in plain words, for the top of the report.

    Args:
        records: The run's ``metrics.jsonl`` lines.
        designer_mode: ``policy``, ``frozen`` or ``off``.
        pool_designer: Whether the designer was the pool designer (answers from files).
        seeded: Envs of the seed pool.
        static: Envs of the static pool (``--pool``).
    """
    out: list[str] = []
    if not records:
        return ["The run wrote no step: it stopped before the first learner step finished."]
    attempts = sum(int(r.get("designer/attempts") or 0) for r in records)
    valid = sum(int(r.get("designer/valid") or 0) for r in records)
    totals: Counter[str] = Counter()
    for r in records:
        for key, n in r.items():
            if key.startswith("designer/outcome/") and n:
                totals[key.removeprefix("designer/outcome/")] += int(n)
    breakdown = outcome_words({f"designer/outcome/{k}": v for k, v in totals.items()})
    who = "the pool designer (answers from files)" if pool_designer else "the designer"
    if designer_mode == "off":
        out.append("The designer was off (the fixed-environment baseline): the agent alone played a fixed pool.")
    elif attempts == 0:
        out.append(f"{who.capitalize()} finished no attempt.")
    elif valid == 0:
        out.append(f"{who.capitalize()} wrote no valid environment in {attempts} attempts ({breakdown}).")
    else:
        out.append(f"{who.capitalize()} wrote {valid} valid environment(s) in {attempts} attempts ({breakdown}).")
    sources = []
    if seeded:
        sources.append(f"the seed pool ({seeded} envs)")
    if static:
        sources.append(f"the static pool ({static} envs)")
    if valid:
        sources.append(f"{valid} designed env(s)")
    trained = [r for r in records if r.get("learner/trained")]
    agent_steps = sum(1 for r in trained if _count(r, "agent_groups"))
    designer_steps = sum(1 for r in trained if _count(r, "designer_trained"))
    if not trained:
        why = records[-1].get("learner/why_not_trained") or why_not_trained(records[-1])
        out.append(f"The learner never trained in {len(records)} step(s) (the last: {why}).")
    elif sources:
        only = " only" if not valid and designer_mode != "off" else ""
        out.append(
            f"The learner trained in {len(trained)} of {len(records)} steps: the agent role in {agent_steps}, on "
            f"plays of {' and '.join(sources)}{only}; the designer role in {designer_steps}."
        )
    first = next((r for r in records if r.get("agent/win_rate") is not None), None)
    last = next((r for r in reversed(records) if r.get("agent/win_rate") is not None), None)
    if first is not None and last is not None:
        out.append(
            f"The agent's mean return (unhinted) went from {_num(first['agent/win_rate'])} at step {first['step']} "
            f"to {_num(last['agent/win_rate'])} at step {last['step']} (solved "
            f"{_pct(first.get('agent/solved_fraction'))} → {_pct(last.get('agent/solved_fraction'))}); "
            "over so few steps and plays this is mostly sampling noise."
        )
    scored = sum(int(r.get("designer/scored") or 0) for r in records)
    if designer_mode != "off":
        if scored:
            nonzero = [
                r["designer/advantage_nonzero_frac"]
                for r in records
                if r.get("designer/advantage_nonzero_frac") is not None
            ]
            learned = sum(_count(r, "designer_trained") for r in records if r.get("learner/trained"))
            if designer_mode == "frozen" or pool_designer:
                fate = "never trained on: the designer is not the policy's"
            elif learned:
                fate = f"{learned} trained on"
            else:
                fate = "none trained on"
            with_signal = sum(1 for frac in nonzero if frac > 0)
            out.append(
                f"{scored} designer sample(s) were scored when their window closed ({fate}); the designer's "
                f"advantages were nonzero in {with_signal} of {len(nonzero)} scored step(s) (on average "
                f"{_pct(_mean(nonzero))} of a scored step's samples had a nonzero advantage)."
            )
        else:
            out.append("No designer sample was scored: no window closed within the run.")
    faults = sum(int(r.get("agent/resource_faults") or 0) for r in records)
    if faults:
        out.append(f"{faults} play(s) ended in a resource fault of the env (counted as return 0).")
    return out
