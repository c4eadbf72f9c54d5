"""Training samples, advantages for both roles, and micro-batching by token budget.

A ``TrainSample`` is one sequence the policy is trained on: the agent's whole multi-turn play
(prompt, every model turn, every observation) or the designer's prompt plus its output. Only tokens
with ``loss_mask`` true train; ``rollout_logprobs[i]`` is the inference engine's logprob of
``token_ids[i]`` (0 where the mask is false).
"""

from __future__ import annotations

import enum
import itertools
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from services.learner.core.window import ScoredAttempt, ScoreOutcome
from spade.envs.types import FinishReason
from spade.signal import SkillBaselines, group_zscores
from spade.signal import designer_advantages as centre_round


class Role(enum.Enum):
    """Which role produced a sample; advantages are normalised per role."""

    AGENT = "agent"
    DESIGNER = "designer"


class BatchError(ValueError):
    """A sample that cannot be trained on (the message names the rule and the value)."""


@dataclass(frozen=True)
class TrainSample:
    """One trainable sequence with its advantage.

    ``constrained`` marks a sequence generated under a grammar (structured output): its rollout
    logprobs come from the masked distribution, not the policy's, so the trainer treats it as
    on-policy at the step (no importance ratio against the rollout logprobs).
    """

    sample_id: str
    role: Role
    token_ids: tuple[int, ...]
    rollout_logprobs: tuple[float, ...]
    loss_mask: tuple[bool, ...]
    weight_version: int
    advantage: float = 0.0
    constrained: bool = False

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if n < 2 or len(self.rollout_logprobs) != n or len(self.loss_mask) != n:
            raise BatchError(
                f"sample {self.sample_id}: token_ids ({n}), rollout_logprobs ({len(self.rollout_logprobs)}) "
                "and loss_mask ({}) must have one entry per token and at least 2 tokens".format(len(self.loss_mask))
            )
        if self.loss_mask[0]:
            raise BatchError(
                f"sample {self.sample_id}: the first token cannot be trained (nothing predicts it); "
                "loss_mask[0] must be false"
            )
        if not math.isfinite(self.advantage):
            raise BatchError(f"sample {self.sample_id}: advantage must be finite, got {self.advantage}")

    @property
    def trained_tokens(self) -> int:
        """Number of tokens with a loss."""
        return sum(self.loss_mask)


ResourceFaultPolicy = Literal["drop", "zero"]
"""What agent plays that ended in a resource fault get: ``drop`` (never trained) or ``zero`` (return 0)."""


@dataclass(frozen=True)
class AgentPlaySample:
    """An agent play with its return, before advantages (a domain copy of the wire sample)."""

    sample: TrainSample
    group_key: str
    episode_return: float
    finish_reason: FinishReason = FinishReason.TERMINATED

    @property
    def resource_fault(self) -> bool:
        """Whether the play ended because the env hit a resource limit."""
        return FinishReason.names_resource_fault(self.finish_reason)


def trainable_members(
    members: Sequence[AgentPlaySample], policy: ResourceFaultPolicy = "drop"
) -> list[tuple[AgentPlaySample, float]]:
    """The plays of a group that train, with the return each trains on.

    A resource fault is dropped (``drop``) or trained as return 0 (``zero``); it is never an ordinary
    truncation.

    >>> s = TrainSample("a", Role.AGENT, (1, 2), (0.0, -1.0), (False, True), 0)
    >>> plays = [AgentPlaySample(s, "g", 1.0), AgentPlaySample(s, "g", 0.0, "fault_memory")]
    >>> [r for _, r in trainable_members(plays)], [r for _, r in trainable_members(plays, "zero")]
    ([1.0], [1.0, 0.0])
    """
    out = []
    for m in members:
        if m.resource_fault:
            if policy == "drop":
                continue
            out.append((m, 0.0))
        else:
            out.append((m, m.episode_return))
    return out


def agent_advantages(
    plays: Sequence[AgentPlaySample], eps: float = 1e-6, policy: ResourceFaultPolicy = "drop"
) -> tuple[list[TrainSample], int, int]:
    """Z-score returns within each group (one env, one window slot, one arm); drop zero-variance groups.

    Resource-fault plays are handled by ``policy`` (``trainable_members``).

    Returns:
        ``(samples with advantages, groups kept, groups dropped for zero variance)``.
    """
    groups: dict[str, list[AgentPlaySample]] = defaultdict(list)
    for p in plays:
        groups[p.group_key].append(p)
    out: list[TrainSample] = []
    dropped = 0
    for members in groups.values():
        kept = trainable_members(members, policy)
        z = group_zscores([r for _, r in kept], eps) if kept else None
        if z is None:
            dropped += 1
            continue
        out.extend(replace(m.sample, advantage=a) for (m, _), a in zip(kept, z, strict=True))
    return out, len(groups) - dropped, dropped


def designer_sample(attempt: ScoredAttempt, advantage: float = 0.0) -> TrainSample:
    """The designer's trained sequence: prompt (untrained) then its output (trained)."""
    a = attempt.attempt
    if not a.output_ids:
        raise BatchError(f"designer sample {a.sample_id} has no output tokens to train")
    if len(a.output_logprobs) != len(a.output_ids):
        raise BatchError(
            f"designer sample {a.sample_id}: {len(a.output_ids)} output tokens but "
            f"{len(a.output_logprobs)} logprobs; the designer must send one logprob per output token"
        )
    prompt = a.prompt_ids or (0,)
    return TrainSample(
        sample_id=a.sample_id,
        role=Role.DESIGNER,
        token_ids=tuple(prompt) + tuple(a.output_ids),
        rollout_logprobs=(0.0,) * len(prompt) + tuple(a.output_logprobs),
        loss_mask=(False,) * len(prompt) + (True,) * len(a.output_ids),
        weight_version=a.weight_version,
        advantage=advantage,
        constrained=a.constrained,
    )


@dataclass
class DesignerAdvantages:
    """The designer's side of a step.

    Attributes:
        samples: The trained designer sequences, with their advantages.
        advantages: Every scored attempt (valid or invalid, trainable or not) with its advantage.
        unscorable: Attempts without a reward (never trained; ``reason_code`` says why).
    """

    samples: list[TrainSample] = field(default_factory=list)
    advantages: list[tuple[ScoredAttempt, float]] = field(default_factory=list)
    unscorable: list[ScoredAttempt] = field(default_factory=list)

    def metrics(self, eps: float = 1e-9) -> dict[str, float]:
        """``designer/advantage_nonzero_frac`` and ``designer/advantage_abs_mean`` (when anything was scored)."""
        if not self.advantages:
            return {}
        values = [a for _, a in self.advantages]
        return {
            "designer/advantage_nonzero_frac": sum(abs(a) > eps for a in values) / len(values),
            "designer/advantage_abs_mean": sum(abs(a) for a in values) / len(values),
        }


def designer_advantages(
    scored: Sequence[ScoredAttempt], baselines: SkillBaselines, eps: float = 1e-9
) -> DesignerAdvantages:
    """Each attempt's blend minus the mean blend of its skill in its round (``spade.signal.designer_advantages``).

    A skill with fewer than 2 scored envs in the round is centred on the running mean of that
    skill's recent blends (``baselines``, updated here), never dropped. Unscorable attempts get no
    advantage; attempts marked untrainable are centred with their round but never trained; an
    attempt whose advantage is 0 carries no signal and is not trained either.
    """
    out = DesignerAdvantages()
    rounds: dict[str, list[ScoredAttempt]] = {}
    for s in scored:
        if s.outcome is ScoreOutcome.UNSCORABLE or s.components is None:
            out.unscorable.append(s)
        else:
            rounds.setdefault(s.attempt.round_key, []).append(s)
    for members in rounds.values():
        blends = [s.components.blend for s in members if s.components is not None]
        advantages = centre_round(blends, [s.attempt.skill for s in members], baselines)
        for s, adv in zip(members, advantages, strict=True):
            out.advantages.append((s, adv))
            if s.attempt.trainable and abs(adv) > eps:
                out.samples.append(designer_sample(s, adv))
    return out


def normalize_per_role(samples: Sequence[TrainSample], eps: float = 1e-6) -> list[TrainSample]:
    """Divide each role's advantages by that role's std in the batch (means are left as they are).

    Agent z-scores and centred designer blends live on different scales (the reference code ran
    designer advantages ×32–50 hotter); scaling each role to unit std gives both roles comparable
    weight in the shared update. A role whose std is below ``eps`` is left unchanged.
    """
    scale: dict[Role, float] = {}
    for role in Role:
        values = [s.advantage for s in samples if s.role is role]
        if len(values) < 2:
            continue
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
        if std >= eps:
            scale[role] = std
    return [replace(s, advantage=s.advantage / scale[s.role]) if s.role in scale else s for s in samples]


def pack_by_tokens(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Group sample indices into micro-batches whose total token count fits ``budget``.

    A micro-batch is packed into one row (``pack``), so its cost is the sum of its lengths, not
    count × longest. Longest first, first fit. A sample longer than the budget gets a micro-batch
    of its own (it cannot be split without changing the loss).

    >>> pack_by_tokens([4, 4, 8, 2], 8)
    [[2], [0, 1], [3]]
    >>> pack_by_tokens([5, 3, 6, 2], 8)
    [[2, 3], [0, 1]]
    """
    if budget < 1:
        raise BatchError(f"micro-batch token budget must be >= 1, got {budget}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    used: list[int] = []
    for i in order:
        for b, members in enumerate(bins):
            if used[b] + lengths[i] <= budget:
                members.append(i)
                used[b] += lengths[i]
                break
        else:
            bins.append([i])
            used.append(lengths[i])
    return bins


def pad_by_tokens(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Like ``pack_by_tokens`` for padded micro-batches (``collate``): count × longest fits ``budget``.

    >>> pad_by_tokens([4, 4, 8, 2], 8)
    [[2], [0, 1], [3]]
    """
    if budget < 1:
        raise BatchError(f"micro-batch token budget must be >= 1, got {budget}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    widths: list[int] = []
    for i in order:
        for b, members in enumerate(bins):
            width = max(widths[b], lengths[i])
            if width * (len(members) + 1) <= budget:
                members.append(i)
                widths[b] = width
                break
        else:
            bins.append([i])
            widths.append(lengths[i])
    return bins


def staleness(samples: Sequence[TrainSample], version: int) -> dict[str, float]:
    """How many weight versions behind the learner each trained sample's weights are, per role.

    ``version`` is the learner's version being updated (the policy the step's gradient is taken
    at); a sample generated by ``weight_version`` v is ``version − v`` behind. Agent samples are the
    rollout's staleness; designer samples are delayed by design (their env's window of ``k``
    versions) and reported apart.

    Returns:
        ``staleness/<role>_mean`` and ``staleness/<role>_max`` for each role in ``samples``.

    >>> s = TrainSample("a", Role.AGENT, (1, 2), (0.0, -1.0), (False, True), weight_version=3)
    >>> staleness([s, replace(s, weight_version=5)], version=5)
    {'staleness/agent_mean': 1.0, 'staleness/agent_max': 2.0}
    """
    out: dict[str, float] = {}
    for role in Role:
        behind = [version - s.weight_version for s in samples if s.role is role]
        if behind:
            out[f"staleness/{role.value}_mean"] = sum(behind) / len(behind)
            out[f"staleness/{role.value}_max"] = float(max(behind))
    return out


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def shareable_prefix(members: Sequence[TrainSample]) -> int:
    """How many leading tokens ``members`` can share in one packed row (``core.collate.pack``).

    The shared tokens are computed once and every member's own tokens attend to them. They must be
    equal in every member, and so must the token after them (the shared part's last position predicts
    it for all members); and none of them may train (a trained token's loss is a member's own: its
    advantage and rollout logprob). So: one less than the longest common prefix, and less than every
    member's first trained token. 0 for fewer than two members.
    """
    if len(members) < 2:
        return 0
    first = members[0].token_ids
    common = min(_common_prefix(first, m.token_ids) for m in members[1:])
    untrained = min(_first_trained(s) for s in members)
    return max(0, min(common - 1, untrained - 1))


def _first_trained(sample: TrainSample) -> int:
    return next((i for i, m in enumerate(sample.loss_mask) if m), len(sample.loss_mask))


def prefix_groups(samples: Sequence[TrainSample]) -> list[tuple[int, list[int]]]:
    """Sample indices grouped to share prompts: ``(shared tokens, members)``, every index once.

    The G plays of an env, and the designer's answers to one prompt template, begin alike; a micro-batch
    packed by these groups computes each group's shared tokens once (the default embedded run's steps:
    27-50% fewer tokens). In token order equal prefixes are neighbours, and a run of neighbours shares
    what ``shareable_prefix`` allows; ``k`` members sharing ``n`` tokens save ``(k − 1) · n``. The runs
    are chosen to save the most tokens in all (dynamic programming over the sorted order, O(n²) after
    one common-prefix length per neighbour pair), so a lone sample that shares only a chat template's
    header never drags a group that shares a whole prompt down to that header. A group of one shares
    nothing (``n = 0``).

    >>> def s(*ids): return TrainSample("x", Role.AGENT, ids, (0.0,) * len(ids), (False,) * (len(ids) - 1) + (True,), 0)
    >>> prefix_groups([s(1, 2, 3, 9), s(5, 6), s(1, 2, 3, 8), s(1, 2, 7)])
    [(2, [2, 0]), (0, [3]), (0, [1])]
    >>> prefix_groups([s(1, 2, 3, 4, 9), s(1, 2, 3, 4, 8), s(1, 7)])
    [(3, [1, 0]), (0, [2])]
    """
    order = sorted(range(len(samples)), key=lambda i: (samples[i].token_ids, i))
    ordered = [samples[i] for i in order]
    n = len(ordered)
    # In token order the common prefix of a run is the least of its neighbours' common prefixes.
    neighbours = [_common_prefix(a.token_ids, b.token_ids) for a, b in itertools.pairwise(ordered)]
    trained = [_first_trained(x) for x in ordered]
    best = [0] * (n + 1)  # best[j]: the most tokens saved by grouping the first j samples
    cut = [0] * (n + 1)  # where the last group of that best grouping starts
    for j in range(1, n + 1):
        best[j], cut[j] = best[j - 1], j - 1  # sample j-1 alone
        common, untrained = len(ordered[j - 1].token_ids) + 1, trained[j - 1]
        for i in range(j - 2, -1, -1):  # the group ordered[i:j]
            common, untrained = min(common, neighbours[i]), min(untrained, trained[i])
            shared = max(0, min(common - 1, untrained - 1))
            if shared == 0:
                break  # a longer run shares no more
            if best[i] + (j - 1 - i) * shared > best[j]:
                best[j], cut[j] = best[i] + (j - 1 - i) * shared, i
    groups: list[tuple[int, list[int]]] = []
    j = n
    while j > 0:
        i = cut[j]
        members = [order[k] for k in range(i, j)]
        groups.append((shareable_prefix([samples[m] for m in members]), members))
        j = i
    return groups[::-1]


def pack_by_prefixes(samples: Sequence[TrainSample], budget: int) -> list[list[int]]:
    """``pack_by_tokens`` for rows with shared prefixes: an env's plays go into one micro-batch.

    Binning samples by their own lengths scatters a group's members over micro-batches, and each
    micro-batch then computes the shared tokens again (in the default embedded run, with 2,048-token
    micro-batches, 54-76% of a step's tokens were computed instead of 50-66%). Here each
    ``prefix_groups`` group is one unit costing its shared tokens once plus each member's own; a group
    too large for ``budget`` is cut into units that fit, each sharing the prefix again. Units are then
    packed longest first, first fit, as ``pack_by_tokens`` does.

    >>> def s(n, p=0):
    ...     ids = (7,) * p + tuple(range(1, n - p + 1))
    ...     return TrainSample("x", Role.AGENT, ids, (0.0,) * n, (False,) * (n - 1) + (True,), 0)
    >>> pack_by_prefixes([s(10, 6), s(4), s(10, 6), s(10, 6)], 16)
    [[0, 2, 3], [1]]
    >>> pack_by_prefixes([s(10, 6), s(10, 6), s(10, 6)], 12)
    [[0, 1], [2]]
    """
    units = _prefix_units(samples, budget)
    bins = pack_by_tokens([cost for cost, _ in units], budget)
    return [sorted(i for u in b for i in units[u][1]) for b in bins]


def _prefix_units(samples: Sequence[TrainSample], budget: int) -> list[tuple[int, list[int]]]:
    """``prefix_groups``'s groups as ``(tokens computed, members)`` units that fit ``budget``: a group
    too large is cut, each part sharing the prefix again."""
    if budget < 1:
        raise BatchError(f"micro-batch token budget must be >= 1, got {budget}")
    units: list[tuple[int, list[int]]] = []
    for shared, members in prefix_groups(samples):
        chunk: list[int] = []
        cost = shared
        for i in members:
            own = len(samples[i].token_ids) - shared
            if chunk and cost + own > budget:
                units.append((cost, chunk))
                chunk, cost = [], shared
            chunk.append(i)
            cost += own
        units.append((cost, chunk))
    return units


def deal_by_prefixes(samples: Sequence[TrainSample], ranks: int, budget: int) -> list[list[int]]:
    """The batch's samples dealt to ``ranks`` data-parallel ranks, an env's plays to one rank.

    Dealt one by one (``samples[rank::ranks]``), an env's G plays land on every rank and each rank
    computes their shared prompt again. Here ``pack_by_prefixes``'s units (a prefix group, or a part of
    one that fits ``budget``) go whole to a rank: largest first, each to the rank with the fewest
    tokens to compute so far (the lowest rank on a tie), so the ranks' loads differ by at most one
    unit. Every rank computes the same dealing from the same batch. Returns each rank's sample indices,
    in batch order (a rank may get none).

    >>> def s(n, p=0):
    ...     ids = (7,) * p + tuple(range(1, n - p + 1))
    ...     return TrainSample("x", Role.AGENT, ids, (0.0,) * n, (False,) * (n - 1) + (True,), 0)
    >>> deal_by_prefixes([s(10, 6), s(4), s(10, 6), s(10, 6), s(3)], 2, 64)
    [[0, 2, 3], [1, 4]]
    """
    if ranks < 1:
        raise BatchError(f"ranks must be >= 1, got {ranks}")
    units = sorted(_prefix_units(samples, budget), key=lambda u: (-u[0], u[1][0]))
    loads = [0] * ranks
    dealt: list[list[int]] = [[] for _ in range(ranks)]
    for cost, members in units:
        rank = min(range(ranks), key=lambda r: (loads[r], r))
        loads[rank] += cost
        dealt[rank].extend(members)
    return [sorted(members) for members in dealt]
