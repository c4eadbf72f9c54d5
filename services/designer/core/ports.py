"""What the designer core needs from the outside world, as protocols and plain data.

The core never imports an adapter nor a wire type: the LLM, the sandbox validator, the environment
memory and the outbox (the queues) are passed in (``services/designer/wiring.py`` builds them), and
everything crossing these ports is a plain dataclass defined here. The adapters
(``services/designer/adapters.py``, ``services/designer/outbox.py``) translate to and from the
inference client, the sandbox, the memory service and the protobuf messages on the queues.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from spade.envs.types import CheckResult, ValidationReport


@dataclass(frozen=True)
class Sampling:
    """Sampling parameters of one designer generation.

    Attributes:
        max_new_tokens: Cap on generated tokens (the environment code plus the hint).
        temperature: Softmax temperature; the reference used 0.6 for both roles.
        top_p: Nucleus sampling mass.
        seed: Optional per-request sampling seed (SGLang's ``sampling_seed``): the same seed, prompt
            and weights give the same tokens.
        regex: Optional constraint: the output must match this regular expression (SGLang's
            ``regex``). A constrained generation's logprobs come from the masked distribution.
    """

    max_new_tokens: int
    temperature: float = 0.6
    top_p: float = 1.0
    seed: int | None = None
    regex: str | None = None


class GenerationLike(Protocol):
    """The parts of an inference result the designer records (``spade.inference.Generation``)."""

    @property
    def output_ids(self) -> Sequence[int]: ...

    @property
    def logprobs(self) -> Sequence[float]: ...

    @property
    def finish_reason(self) -> str: ...

    @property
    def weight_version(self) -> int: ...

    @property
    def text(self) -> str: ...


class PolicyLLM(Protocol):
    """The policy being trained, served by SGLang or the embedded server."""

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of ``messages`` rendered with the model's chat template and a generation prompt."""
        ...

    async def generate(self, input_ids: list[int], sampling: Sampling) -> GenerationLike:
        """Sample a continuation of ``input_ids``; returns its token ids, logprobs and weight version."""
        ...


class Validator(Protocol):
    """Runs the validation pipeline on untrusted code (the sandbox pool or the sandbox service)."""

    async def validate(self, code: str, setting: str, *, agent_max_turns: int) -> ValidationReport:
        """Validate ``code`` as an environment of ``setting``; never raises for bad code.

        ``agent_max_turns`` is the agent's turn budget (the run spec's): ``solution()`` must win
        within it, and an env declaring a larger ``max_turns`` is clamped to it (and the report says so).
        """
        ...


@dataclass(frozen=True)
class MemoryExample:
    """One earlier environment shown to the designer.

    Attributes:
        code: A code excerpt (the memory decides how long; the prompt builder may cut it further).
        reason: Why it is shown: ``"learnable: win rate 0.45, regret 0.30"`` or ``"too easy: ..."``.
        skill: The skill it was designed for.
    """

    code: str
    reason: str
    skill: str = ""


@dataclass(frozen=True)
class MemoryExamples:
    """Positives (imitate the quality, not the game) and negatives (avoid) for one prompt."""

    positives: tuple[MemoryExample, ...] = ()
    negatives: tuple[MemoryExample, ...] = ()


@dataclass(frozen=True)
class EnvironmentRecord:
    """An environment the designer asks the memory to store (valid, or invalid with its report).

    Attributes:
        valid: Whether every validation check passed (invalid ones are kept for inspection).
        setting: ``"game"`` or ``"tool"``.
        skill: The skill it was designed for.
        code: The code after repairs (what sessions load).
        hint: The privileged hint from the designer's answer.
        env_class: Name of the environment class the validator found.
        checks: The validation checks in pipeline order.
        weight_version: Policy version that wrote it (its window starts here).
        designer_sample_id: The designer sample to score when its window closes.
        batch_id: The regeneration batch it belongs to.
        source: Metadata of the corpus document it was grounded in (never shown to the model).
    """

    valid: bool
    setting: str
    skill: str
    code: str
    hint: str
    env_class: str
    checks: tuple[CheckResult, ...]
    weight_version: int
    designer_sample_id: str
    batch_id: str
    source: dict[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class StoreResult:
    """Outcome of storing an environment.

    Attributes:
        env_id: Id of the stored environment, or of the existing one it duplicates.
        duplicate: True when the memory already held an equivalent environment (nothing new stored).
    """

    env_id: str
    duplicate: bool = False


@dataclass(frozen=True)
class AttemptSummary:
    """One designer attempt as the memory counts it (validity figures count malformed answers too).

    Attributes:
        sample_id: The attempt's designer sample id (the memory records each once).
        setting: ``"game"`` or ``"tool"``.
        skill: The skill it was designed for.
        batch_id: The round id.
        weight_version: Policy version that wrote it (-1 for a pool answer).
        outcome: ``"valid"``, ``"malformed"``, ``"duplicate"`` or the failing check's name.
        env_id: The stored environment, ``""`` when none.
        spec_id: The run spec.
    """

    sample_id: str
    setting: str
    skill: str
    batch_id: str
    weight_version: int
    outcome: str
    env_id: str
    spec_id: str


class EnvironmentMemory(Protocol):
    """The environment memory: examples for prompts, dedup and storage of new environments."""

    async def sample_examples(self, setting: str, skill: str, n_positive: int, n_negative: int) -> MemoryExamples:
        """Up to ``n_positive`` learnable and ``n_negative`` too-easy/too-hard earlier environments."""
        ...

    async def store(self, record: EnvironmentRecord) -> StoreResult:
        """Store ``record`` unless an equivalent environment exists (then return that one's id)."""
        ...

    async def record_attempts(self, attempts: Sequence[AttemptSummary]) -> None:
        """Record finished attempts (idempotent by sample id)."""
        ...


@dataclass(frozen=True)
class EnvReady:
    """A new valid environment, announced to the rollout (``envs.ready``).

    Attributes:
        env_id: The stored environment.
        setting: ``"game"`` or ``"tool"``.
        skill: The skill it was designed for.
        weight_version: Policy version that designed it (the rollout fixes its window when it
            first plays it, WAVE2 §3).
        designer_sample_id: The designer sample to score when its window closes.
        spec_id: The run spec it was designed under.
    """

    env_id: str
    setting: str
    skill: str
    weight_version: int
    designer_sample_id: str
    spec_id: str = ""


@dataclass(frozen=True)
class DesignerSample:
    """One designer attempt as the learner trains on it (``samples.designer``).

    Attributes:
        sample_id: The attempt's id (also the queue's idempotency key).
        env_id: The stored environment, ``""`` when the attempt stored none.
        setting: ``"game"`` or ``"tool"``.
        skill: The skill it was designed for.
        prompt_ids: Chat-templated prompt token ids the output was conditioned on.
        output_ids: Generated token ids.
        output_logprobs: Rollout logprob of each output token.
        weight_version: Policy version that generated the output.
        valid: Whether the environment passed every check and was stored as new.
        failed_check: The first failing check, ``""`` when valid.
        checks: Every check result in pipeline order.
        batch_id: The round id (the learner centres rewards within (round, skill)).
        spec_id: The run spec the attempt was made under.
        trainable: False for attempts that are scored but never trained on (a pool designer's
            answers, a frozen designer's).
        outcome: ``"valid"``, ``"malformed"``, ``"duplicate"`` or the failing check's name.
        constrained: The output was generated under a grammar (structured output): its logprobs
            come from the masked distribution, not the policy's own.
    """

    sample_id: str
    env_id: str
    setting: str
    skill: str
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    output_logprobs: tuple[float, ...]
    weight_version: int
    valid: bool
    failed_check: str
    checks: tuple[CheckResult, ...]
    batch_id: str
    spec_id: str = ""
    trainable: bool = True
    outcome: str = ""
    constrained: bool = False


class Outbox(Protocol):
    """Where the designer's results go (the work queues ``envs.ready`` and ``samples.designer``).

    Both publishes are idempotent by id (the env's, the sample's) and wait at most ``timeout_s`` for
    room in a full queue; any failure raises.
    """

    async def publish_env_ready(self, ready: EnvReady, *, timeout_s: float) -> None:
        """Announce a new valid environment to the rollout."""
        ...

    async def publish_sample(self, sample: DesignerSample, *, timeout_s: float) -> None:
        """Hand a designer sample to the learner."""
        ...
