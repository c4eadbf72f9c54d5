"""Adapters from the real dependencies to the designer core's protocols (``core/ports.py``).

Each one translates, nothing more: the inference client's ``Generation`` (string weight versions)
into the core's integers, the sandbox's validation reports (in-process pool or gRPC) into the core's
``ValidationResult``, and the memory service (in-process or its client, which offer the same
methods) into ``EnvironmentMemory``. The queues are behind ``outbox.QueueOutbox``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from services.designer.core.ports import (
    Check,
    EnvironmentRecord,
    MemoryExample,
    MemoryExamples,
    Sampling,
    StoreResult,
    ValidationResult,
)


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
        )
        generation = await self._client.generate(input_ids, params)
        return PolicyGeneration(
            output_ids=list(generation.output_ids),
            logprobs=list(generation.logprobs),
            finish_reason=str(generation.finish_reason),
            weight_version=parse_weight_version(generation.weight_version),
            text=generation.text,
        )


class _CheckLike(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def passed(self) -> bool: ...

    @property
    def detail(self) -> str: ...


class _ReportLike(Protocol):
    @property
    def valid(self) -> bool: ...

    @property
    def checks(self) -> Sequence[_CheckLike]: ...

    @property
    def repaired_code(self) -> str: ...

    @property
    def env_class(self) -> str: ...


def validation_result(report: _ReportLike) -> ValidationResult:
    """The core's ``ValidationResult`` of a sandbox report (``spade.envs.ValidationReport`` or its message)."""
    return ValidationResult(
        valid=bool(report.valid),
        checks=tuple(Check(c.name, bool(c.passed), c.detail) for c in report.checks),
        repaired_code=report.repaired_code,
        env_class=report.env_class,
    )


class _PoolBackend(Protocol):
    async def validate(self, code: str, setting: str, config: Any) -> Any: ...


class PoolValidator:
    """``Validator`` over the sandbox's isolated worker pool (embedded mode).

    Args:
        backend: ``services.sandbox.isolation.SandboxPool`` (started).
        checks: The ``spade.envs.CheckConfig`` the checks run with.
    """

    def __init__(self, backend: _PoolBackend, checks: Any) -> None:
        self._backend = backend
        self._checks = checks

    async def validate(self, code: str, setting: str) -> ValidationResult:
        """Run the validation pipeline in an isolated worker."""
        return validation_result(await self._backend.validate(code, setting, self._checks))


class GrpcValidator:
    """``Validator`` over the sandbox service's gRPC API (distributed mode).

    Args:
        channel: A ``grpc.aio`` channel to the sandbox.
        api_key: Bearer key of this tenant (``None`` only against a dev-mode sandbox).
        timeout_s: Deadline of one validation call.
    """

    def __init__(self, channel: Any, *, api_key: str | None, timeout_s: float = 120.0) -> None:
        from spade.v1 import sandbox_pb2_grpc

        self._stub = sandbox_pb2_grpc.SandboxStub(channel)
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self._timeout_s = timeout_s

    async def validate(self, code: str, setting: str) -> ValidationResult:
        """The sandbox's ``ValidationReport`` message, as the core's ``ValidationResult``."""
        from spade.v1 import sandbox_pb2

        request = sandbox_pb2.ValidateRequest(code=code, setting=setting)
        return validation_result(await self._stub.Validate(request, metadata=self._metadata, timeout=self._timeout_s))


class _Memory(Protocol):
    async def put_environment(self, env: Any) -> Any: ...

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
    """

    def __init__(self, memory: _Memory) -> None:
        self._memory = memory

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
            setting=record.setting,
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
