"""Adapters from the real dependencies to the designer core's protocols (``core/ports.py``).

Each one translates, nothing more: the inference client's ``Generation`` (string weight versions)
into the core's integers, the sandbox (the in-process pool, or the sandbox service through the
shared ``spade.sandbox.client.SandboxClient``, both answering ``spade.envs.ValidationReport``) into
the core's ``Validator``, and the memory service (in-process or its client, which offer the same
methods) into ``EnvironmentMemory``, an attempt's record retried while the memory is unavailable. The
queues are behind ``outbox.QueueOutbox``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from services.designer.core.ports import (
    AttemptSummary,
    EnvironmentRecord,
    MemoryExample,
    MemoryExamples,
    Sampling,
    StoreResult,
)
from spade.envs import CheckConfig, ValidationReport
from spade.envs.types import Setting
from spade.retry import RetryPolicy
from spade.serving.logs import get_logger

if TYPE_CHECKING:
    from spade.sandbox.client import SandboxClient

log = get_logger(__name__)


def parse_weight_version(value: str | int | None) -> int:
    """The integer weight version of a server's ``weight_version`` string.

    SGLang reports ``"default"`` until the first weight update; that is version 0.

    >>> parse_weight_version("12"), parse_weight_version(None), parse_weight_version("v3")
    (12, 0, 3)

    Raises:
        ValueError: Neither an integer, ``"v<int>"``, ``"default"`` nor empty.
    """
    if value is None or value in {"", "default"}:
        return 0
    if isinstance(value, int):
        return value
    text = value.strip().lower().removeprefix("v")
    if text.isdigit():
        return int(text)
    raise ValueError(
        f"weight_version {value!r} is not an integer: publish weights with integer versions (update_weights_from_disk)"
    )


@dataclass(frozen=True)
class PolicyGeneration:
    """A generation with an integer weight version (``core.ports.GenerationLike``)."""

    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    weight_version: int
    text: str


class _InferenceClient(Protocol):
    def apply_chat_template(self, messages: Any, tools: Any = None) -> list[int]: ...

    async def generate(self, input_ids: Sequence[int], sampling: Any = None) -> Any: ...


class InferencePolicy:
    """``PolicyLLM`` over ``spade.inference.InferenceClient`` (SGLang or the embedded server)."""

    def __init__(self, client: _InferenceClient) -> None:
        self._client = client

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        """Chat-templated prompt ids, ending with the assistant header."""
        return list(self._client.apply_chat_template(messages))

    async def generate(self, input_ids: list[int], sampling: Sampling) -> PolicyGeneration:
        """Generate with logprobs; the weight version comes from the server that answered."""
        from spade.inference.protocol import SamplingParams

        params = SamplingParams(
            max_new_tokens=sampling.max_new_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            sampling_seed=sampling.seed,
            regex=sampling.regex,
        )
        generation = await self._client.generate(input_ids, params)
        return PolicyGeneration(
            output_ids=list(generation.output_ids),
            logprobs=list(generation.logprobs),
            finish_reason=str(generation.finish_reason),
            weight_version=parse_weight_version(generation.weight_version),
            text=generation.text,
        )


class _Pool(Protocol):
    async def validate(self, code: str, setting: str, config: CheckConfig) -> ValidationReport: ...


def checks_within(checks: CheckConfig, agent_max_turns: int) -> CheckConfig:
    """``checks`` with the agent's turn budget as the cap (what the sandbox service does per request)."""
    return dataclasses.replace(
        checks,
        max_turns_cap=agent_max_turns,
        default_max_turns=min(checks.default_max_turns, agent_max_turns),
    )


class PoolValidator:
    """``Validator`` over the sandbox's isolated worker pool (embedded mode).

    Args:
        pool: ``services.sandbox.isolation.SandboxPool`` (started).
        checks: The limits and thresholds the checks run with (the turn cap is the agent's budget
            each call names).
    """

    def __init__(self, pool: _Pool, checks: CheckConfig) -> None:
        self._pool = pool
        self._checks = checks

    async def validate(self, code: str, setting: str, *, agent_max_turns: int) -> ValidationReport:
        """Run the validation pipeline in an isolated worker, within the agent's turn budget."""
        return await self._pool.validate(code, setting, checks_within(self._checks, agent_max_turns))


class SandboxServiceValidator:
    """``Validator`` over the sandbox service (distributed mode), through the shared sandbox client.

    Args:
        client: ``spade.sandbox.client.SandboxClient`` (it retries transient failures and raises
            ``SandboxFault``/``SandboxRefused``, which the designer counts as infrastructure failures).
    """

    def __init__(self, client: SandboxClient) -> None:
        self._client = client

    async def validate(self, code: str, setting: str, *, agent_max_turns: int) -> ValidationReport:
        """Validate through the sandbox service's ``Validate`` call, within the agent's turn budget."""
        return await self._client.validate(code, setting, agent_max_turns=agent_max_turns)


class _Memory(Protocol):
    async def put_environment(self, env: Any) -> Any: ...

    async def record_attempts(self, attempts: Sequence[Any]) -> Any: ...

    async def sample_examples(
        self, setting: str, skill: str, n_positive: int, n_negative: int, seed: int | None = None
    ) -> Any: ...


def corpus_ref(source: dict[str, object]) -> str:
    """A short reference to a corpus document from its metadata (name, id or line)."""
    for key in ("name", "id", "url", "title"):
        if source.get(key):
            return str(source[key])[:500]
    return f"line {source['line']}" if "line" in source else ""


class MemoryServiceEnvironments:
    """``EnvironmentMemory`` over the memory service: its application layer
    (``services.memory.service.MemoryService``, in-process) or its gRPC client, which offer the same methods.

    Args:
        memory: The memory service or its client.
        record_retry: Tries of recording attempts while the memory is unavailable (restarting, its
            database down): the attempt's sample is already published, so its record waits for the
            memory instead of being dropped (the memory stores each sample id once). ``None``: one try.
    """

    def __init__(self, memory: _Memory, *, record_retry: RetryPolicy | None = None) -> None:
        self._memory = memory
        self._record_retry = record_retry or RetryPolicy(attempts=1)

    async def sample_examples(self, setting: str, skill: str, n_positive: int, n_negative: int) -> MemoryExamples:
        """The memory's examples as plain prompt data."""
        found = await self._memory.sample_examples(setting, skill, n_positive, n_negative)
        return MemoryExamples(
            positives=tuple(MemoryExample(code=e.code, reason=e.reason, skill=e.skill) for e in found.positives),
            negatives=tuple(MemoryExample(code=e.code, reason=e.reason, skill=e.skill) for e in found.negatives),
        )

    async def store(self, record: EnvironmentRecord) -> StoreResult:
        """Store the environment (valid or invalid, with its report); duplicates are reported."""
        from spade.memory.records import EnvStatus, NewEnvironment

        report = {
            "valid": record.valid,
            "setting": record.setting,
            "env_class": record.env_class,
            "checks": [{"name": c.name, "passed": c.passed, "detail": c.detail} for c in record.checks],
        }
        env = NewEnvironment(
            setting=Setting.parse(record.setting),
            skill=record.skill,
            code=record.code,
            hint=record.hint,
            validation_report=json.loads(json.dumps(report)),
            status=EnvStatus.VALID if record.valid else EnvStatus.INVALID,
            weight_version=record.weight_version,
            designer_sample_id=record.designer_sample_id,
            env_class=record.env_class,
            corpus_ref=corpus_ref(record.source),
            batch_id=record.batch_id,
        )
        result = await self._memory.put_environment(env)
        return StoreResult(env_id=result.env_id, duplicate=bool(result.duplicate))

    async def record_attempts(self, attempts: Sequence[AttemptSummary]) -> None:
        """Record finished attempts (``RecordAttempts``), so validity figures count malformed answers."""
        from spade.memory.errors import MemoryUnavailable
        from spade.memory.records import DesignerAttempt

        # The core's summary has the memory record's fields (the store stamps created_at).
        records = [DesignerAttempt(**{**dataclasses.asdict(a), "setting": Setting.parse(a.setting)}) for a in attempts]
        retrying = self._record_retry.async_retrying(
            MemoryUnavailable, logger=log, what=f"recording {len(records)} designer attempts in the memory"
        )
        async for attempt in retrying:
            with attempt:
                await self._memory.record_attempts(records)
