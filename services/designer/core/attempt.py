"""One designer attempt, its explicit outcome, and the ``DesignerSample`` it becomes.

Every attempt whose output the policy produced becomes a designer sample, valid or not: the learner
scores invalid and malformed ones 0 and valid ones by regret + plateau once their window closes.
Attempts that failed for reasons outside the designer's control (the inference server or the
sandbox/memory/queue infrastructure) carry no trainable output and produce no sample: punishing the
policy for an outage would teach it nothing true.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from services.designer.core.ports import AttemptSummary, DesignerSample
from spade.envs.types import CheckResult

DUPLICATE_CHECK = "duplicate"


class AttemptOutcome(enum.Enum):
    """How an attempt ended."""

    VALID = "valid"
    """Passed every check and was stored as a new environment."""
    INVALID = "invalid"
    """Well-formed answer whose environment failed a validation check."""
    MALFORMED = "malformed"
    """The answer lacks the code block or the hint section."""
    DUPLICATE = "duplicate"
    """Valid, but the memory already held an equivalent environment."""
    GENERATION_FAILED = "generation_failed"
    """The inference call failed: no output to train on."""
    INFRA_FAILED = "infra_failed"
    """The sandbox, memory or queue failed: not the designer's fault, no sample."""

    @property
    def yields_sample(self) -> bool:
        """Whether the attempt yields a designer sample (it has output the designer is answerable for)."""
        return self not in (AttemptOutcome.GENERATION_FAILED, AttemptOutcome.INFRA_FAILED)


@dataclass(frozen=True)
class AttemptRecord:
    """Everything one attempt produced.

    Attributes:
        sample_id: Id of its designer sample (also the queue idempotency key).
        batch_id: The round id.
        slot: Index of the environment slot within the round.
        attempt: 0-based attempt number within the slot.
        setting: ``"game"`` or ``"tool"``.
        skill: Target skill name.
        outcome: How it ended.
        prompt_ids: Chat-templated prompt token ids.
        prompt_messages: The chat messages those ids were rendered from (for inspection).
        output_ids: Generated token ids (code + hint).
        logprobs: Rollout logprob of each output token.
        weight_version: Policy version that generated the output (-1 when nothing was generated).
        finish_reason: The inference server's finish reason (``"stop"``, ``"length"``, ...).
        checks: Check results in pipeline order.
        env_id: Stored environment id: the new env for ``VALID``, the stored invalid one for
            ``INVALID`` (kept with its report), ``""`` otherwise.
        code: Extracted environment code (after repairs when validated), ``""`` when none.
        hint: Parsed hint, ``""`` when none.
        text: The raw generated text.
        error: What failed, for ``GENERATION_FAILED``/``INFRA_FAILED``.
        source: Corpus document metadata (a pool answer: its file).
        round_index: The round's index (drives its skills and the sampling seeds).
        spec_id: The run spec.
        trainable: False when the sample is scored but never trained on (pool, frozen designer).
        constrained: The output was generated under the answer-format grammar.
    """

    sample_id: str
    batch_id: str
    slot: int
    attempt: int
    setting: str
    skill: str
    outcome: AttemptOutcome
    prompt_ids: Sequence[int] = ()
    prompt_messages: tuple[dict[str, str], ...] = ()
    output_ids: Sequence[int] = ()
    logprobs: Sequence[float] = ()
    weight_version: int = -1
    finish_reason: str = ""
    checks: tuple[CheckResult, ...] = ()
    env_id: str = ""
    code: str = ""
    hint: str = ""
    text: str = ""
    error: str = ""
    source: dict[str, object] = field(default_factory=dict)
    round_index: int = 0
    spec_id: str = ""
    trainable: bool = True
    constrained: bool = False

    @property
    def failed_check(self) -> str:
        """Name of the first failing check, ``""`` when none failed."""
        for check in self.checks:
            if not check.passed:
                return check.name
        return ""

    @property
    def label(self) -> str:
        """The outcome as samples, the memory and logs name it.

        ``"valid"``, ``"malformed"``, ``"duplicate"``, the failing check's name for an invalid
        attempt, or ``"generation_failed"`` / ``"infra_failed"``.
        """
        if self.outcome is AttemptOutcome.INVALID:
            return self.failed_check or "validation"
        return self.outcome.value

    def summary(self) -> AttemptSummary:
        """What the memory records of this attempt."""
        return AttemptSummary(
            sample_id=self.sample_id,
            setting=self.setting,
            skill=self.skill,
            batch_id=self.batch_id,
            weight_version=self.weight_version,
            outcome=self.label,
            env_id=self.env_id,
            spec_id=self.spec_id,
        )


def to_designer_sample(record: AttemptRecord) -> DesignerSample:
    """The designer sample of ``record`` (what goes to ``samples.designer``).

    Raises:
        ValueError: The attempt has no trainable output (``GENERATION_FAILED``/``INFRA_FAILED``), or
            its token ids and logprobs differ in length.
    """
    if not record.outcome.yields_sample:
        raise ValueError(f"attempt {record.sample_id} ended {record.outcome.value}: it has no designer sample")
    if len(record.output_ids) != len(record.logprobs):
        raise ValueError(
            f"attempt {record.sample_id}: {len(record.output_ids)} output ids but {len(record.logprobs)} "
            "logprobs; the inference server must return one logprob per generated token"
        )
    valid = record.outcome is AttemptOutcome.VALID
    return DesignerSample(
        sample_id=record.sample_id,
        env_id=record.env_id,
        setting=record.setting,
        skill=record.skill,
        prompt_ids=tuple(record.prompt_ids),
        output_ids=tuple(record.output_ids),
        output_logprobs=tuple(record.logprobs),
        weight_version=record.weight_version,
        valid=valid,
        failed_check="" if valid else record.failed_check,
        checks=record.checks,
        batch_id=record.batch_id,
        spec_id=record.spec_id,
        trainable=record.trainable,
        outcome=record.label,
        constrained=record.constrained,
    )
