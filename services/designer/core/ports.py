"""What the designer core needs from the outside world, as protocols and plain data.

The core never imports an adapter: the LLM, the sandbox validator, the environment memory and the
queues are passed in (``services/designer/wiring.py`` builds them). Each protocol is the smallest
surface the loop uses, so the real implementations (inference client, sandbox pool or gRPC client,
memory store, work queue) fit directly or through a few-line adapter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class Sampling:
    """Sampling parameters of one designer generation.

    Attributes:
        max_new_tokens: Cap on generated tokens (the environment code plus the hint).
        temperature: Softmax temperature; the reference used 0.6 for both roles.
        top_p: Nucleus sampling mass.
        seed: Optional per-request sampling seed (reproducible generations where the server supports it).
    """

    max_new_tokens: int
    temperature: float = 0.6
    top_p: float = 1.0
    seed: int | None = None


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


class CheckLike(Protocol):
    """One named validation check (DESIGN §4)."""

    @property
    def name(self) -> str: ...

    @property
    def passed(self) -> bool: ...

    @property
    def detail(self) -> str: ...


class ReportLike(Protocol):
    """A validation report: every check named, the first failure explained."""

    @property
    def valid(self) -> bool: ...

    @property
    def checks(self) -> Sequence[CheckLike]: ...

    @property
    def repaired_code(self) -> str: ...

    @property
    def env_class(self) -> str: ...


class Validator(Protocol):
    """Runs the validation pipeline on untrusted code (the sandbox pool or its gRPC client)."""

    async def validate(self, code: str, setting: str) -> ReportLike:
        """Validate ``code`` as an environment of ``setting``; never raises for bad code."""
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
        checks: The validation checks ``(name, passed, detail)`` in pipeline order.
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
    checks: tuple[tuple[str, bool, str], ...]
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


class EnvironmentMemory(Protocol):
    """The environment memory: examples for prompts, dedup and storage of new environments."""

    async def sample_examples(self, setting: str, skill: str, n_positive: int, n_negative: int) -> MemoryExamples:
        """Up to ``n_positive`` learnable and ``n_negative`` too-easy/too-hard earlier environments."""
        ...

    async def store(self, record: EnvironmentRecord) -> StoreResult:
        """Store ``record`` unless an equivalent environment exists (then return that one's id)."""
        ...
