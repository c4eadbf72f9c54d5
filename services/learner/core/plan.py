"""What one step trains: a pure decision over the buffered plays and the designer window.

``plan_step`` reads the learner's buffer and changes nothing; the learner applies the plan
afterwards (``Intake.apply``) and adopts its skill baselines. In order:

1. a group holding a play more than ``max_staleness`` versions behind the learner is dropped
   (``DropReason.STALE``);
2. the complete groups (G plays) are ready; when fewer than ``groups_per_step`` are, the fill timed
   out, and groups of at least two plays from an older version (they will not grow any more) are
   ready too. Oldest first, a ready group without a learning signal is dropped
   (``DropReason.ZERO_VARIANCE``: it never takes a trainable group's place) and the others are
   chosen up to ``groups_per_step``. Fewer than ``max(1, min_groups)`` chosen: no group trains this
   step, and the chosen ones stay buffered;
3. the chosen plays get their z-scores (``agent_advantages``, resource faults dropped or zeroed);
4. the designer rounds whose windows are done are scored (``DesignerWindow.score_due``) and centred
   per (round, skill) on a copy of the skill baselines (``designer_advantages``);
5. with ``role_normalization``, each role's advantages are scaled to unit std.

Every figure of the step's report that comes from this decision is in ``StepPlan.counters``.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from services.learner.core.batching import (
    AgentPlaySample,
    DesignerAdvantages,
    ResourceFaultPolicy,
    TrainSample,
    agent_advantages,
    designer_advantages,
    normalize_per_role,
    trainable_members,
)
from services.learner.core.window import DesignerWindow, ScoredAttempt
from spade.signal import SkillBaselines, group_has_signal


class DropReason(enum.Enum):
    """Why a buffered agent group was dropped without training."""

    STALE = "stale"
    """One of its plays was generated more than ``max_staleness`` versions before the learner's."""
    ZERO_VARIANCE = "zero_variance"
    """Its trainable returns are all equal (or fewer than two): no learning signal."""


@dataclass(frozen=True)
class PlanRules:
    """The settings a step plan follows (the learner settings' and the run spec's).

    Attributes:
        group_size: G, the plays of a complete group.
        groups_per_step: Complete groups a step trains at most (``agent_groups_per_step``).
        min_groups: Fewer trainable groups than this (at least 1): the step trains no agent group.
        max_staleness: Versions a play may lag the learner before its group is dropped.
        resource_fault_policy: ``drop`` or ``zero`` for plays that ended in a resource fault.
        role_normalization: Scale each role's advantages to unit std.
    """

    group_size: int
    groups_per_step: int
    min_groups: int = 1
    max_staleness: int = 0
    resource_fault_policy: ResourceFaultPolicy = "drop"
    role_normalization: bool = True


@dataclass(frozen=True)
class StepPlan:
    """What trains this step, and what was dropped and why.

    Attributes:
        batch: The samples to train on, with their advantages (empty: nothing trains).
        trained: The agent groups in ``batch`` (to remove from the buffer).
        dropped: Agent groups dropped without training, with the reason (to remove as well).
        scored: The designer attempts whose round is due (to release from the window).
        designer: Their advantages, the trained designer samples and the unscorable attempts.
        baselines: The skill baselines after this step's rounds (the learner adopts them).
        counters: This plan's counts for the step report (``stale_dropped``, ``agent_groups``, ...).
        advantages: ``agent/advantage_abs_mean`` and the designer's advantage metrics, when present.
    """

    batch: list[TrainSample]
    trained: list[str]
    dropped: dict[str, DropReason]
    scored: list[ScoredAttempt]
    designer: DesignerAdvantages
    baselines: SkillBaselines
    counters: Counter[str]
    advantages: dict[str, float]


def complete_groups(groups: Mapping[str, Sequence[AgentPlaySample]], group_size: int) -> list[str]:
    """The keys of the groups holding at least ``group_size`` plays (buffer order)."""
    return [k for k, v in groups.items() if len(v) >= group_size]


def has_signal(members: Sequence[AgentPlaySample], policy: ResourceFaultPolicy = "drop") -> bool:
    """Whether a group's trainable returns can train (``spade.signal.group_has_signal``)."""
    return group_has_signal([r for _, r in trainable_members(members, policy)])


def plan_step(
    groups: Mapping[str, Sequence[AgentPlaySample]],
    window: DesignerWindow,
    baselines: SkillBaselines,
    version: int,
    rules: PlanRules,
) -> StepPlan:
    """Decide what trains at learner version ``version`` (see the module docstring); nothing is modified.

    Args:
        groups: The buffered agent plays by advantage group, in arrival order.
        window: The designer window (read only: ``score_due``).
        baselines: The skill baselines before this step (copied, never changed).
        version: The learner's weight version (the step trains version + 1).
        rules: The settings the plan follows.
    """
    counts: Counter[str] = Counter()
    dropped: dict[str, DropReason] = {}
    floor = version - rules.max_staleness
    live: dict[str, Sequence[AgentPlaySample]] = {}
    for key, members in groups.items():
        if min(p.sample.weight_version for p in members) < floor:
            dropped[key] = DropReason.STALE
            counts["stale_dropped"] += len(members)
            counts["stale_groups_dropped"] += 1
        else:
            live[key] = members
    trained = _choose_groups(live, version, rules, dropped, counts)

    plays = [p for key in trained for p in live[key]]
    faults = sum(1 for p in plays if p.resource_fault)
    if faults:
        counts["resource_fault_dropped" if rules.resource_fault_policy == "drop" else "resource_fault_zeroed"] += faults
    agent, kept, zero_variance = agent_advantages(plays, policy=rules.resource_fault_policy)
    counts["agent_groups"] += kept
    counts["agent_groups_zero_variance"] += zero_variance
    advantages: dict[str, float] = {}
    if agent:
        advantages["agent/advantage_abs_mean"] = sum(abs(s.advantage) for s in agent) / len(agent)

    scored = window.score_due(version)
    after = SkillBaselines(length=baselines.length, recent=baselines.recent)  # a copy: its deques are new
    designer = designer_advantages(scored, after)
    _count_designer(scored, designer, counts)
    advantages.update(designer.metrics())

    batch = agent + designer.samples
    if rules.role_normalization:
        batch = normalize_per_role(batch)
    counts["trained_samples"] = len(batch)
    return StepPlan(batch, trained, dropped, scored, designer, after, counts, advantages)


def _choose_groups(
    groups: Mapping[str, Sequence[AgentPlaySample]],
    version: int,
    rules: PlanRules,
    dropped: dict[str, DropReason],
    counts: Counter[str],
) -> list[str]:
    """The groups that train (oldest first); ready groups without signal go into ``dropped``."""
    ready = complete_groups(groups, rules.group_size)
    if len(ready) < rules.groups_per_step:
        # The fill timed out: groups of an older version will not grow any more; take them too.
        ready += [
            k
            for k, v in groups.items()
            if k not in ready and len(v) >= 2 and max(p.sample.weight_version for p in v) < version
        ]
    ready.sort(key=lambda k: min(p.sample.weight_version for p in groups[k]))
    chosen: list[str] = []
    for key in ready:
        if not has_signal(groups[key], rules.resource_fault_policy):
            # No learning signal: drop it now so it never takes a trainable group's place.
            dropped[key] = DropReason.ZERO_VARIANCE
            counts["agent_groups_zero_variance"] += 1
            counts["zero_variance_dropped"] += len(groups[key])
        elif len(chosen) < rules.groups_per_step:
            chosen.append(key)
    if len(chosen) < max(1, rules.min_groups):
        return []
    return chosen


def _count_designer(scored: Sequence[ScoredAttempt], designer: DesignerAdvantages, counts: Counter[str]) -> None:
    if scored:
        counts["designer_rounds"] += len({s.attempt.round_key for s in scored})
    for s in scored:
        counts[f"designer_{s.outcome.value}"] += 1
        if not s.attempt.trainable:
            counts["designer_untrainable"] += 1
        if s.trivially_won:
            counts["designer_trivially_won"] += 1
    for s in designer.unscorable:
        code = s.reason_code.value if s.reason_code is not None else "unknown"
        counts[f"designer_unscored/{code}"] += 1
    if designer.advantages:
        counts["designer_trained"] += len(designer.samples)
        counts["designer_zero_advantage"] += sum(
            1 for s, a in designer.advantages if s.attempt.trainable and abs(a) <= 1e-9
        )
