"""Fixtures for the designer loop: the real SQLite memory, a scripted policy, a recording outbox.

The policy is scripted because the loop's handling of specific answers (valid, malformed, invalid,
duplicate, slow, failing) is what is tested here; the real model runs in the integration tests.
The validator stand-in returns the core's ``ValidationReport`` decided by a marker in the code, so
each check outcome can be produced on purpose. The core speaks domain types only, so its tests read
what it published from ``RecordingOutbox`` (the outbox that keeps every result, in order); the
translation to protobuf on the real queues is tested in ``test_outbox.py`` and the integration tests.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from services.designer.adapters import MemoryServiceEnvironments, PolicyGeneration
from services.designer.core.loop import Designer, DesignerConfig
from services.designer.core.pipeline import AttemptPipeline, PipelineConfig, SeedDeriver
from services.designer.core.ports import (
    DesignerSample,
    EnvironmentMemory,
    EnvReady,
    Sampling,
)
from services.designer.core.prompts import ExampleEnv
from services.designer.core.reachability import CriteriaReachable
from services.designer.corpus.loader import CorpusSampler, parse_lines
from services.memory.service import MemoryService
from services.memory.store.sql import SqlStore, make_engine, migrate
from spade.envs import CHECK_NAMES
from spade.envs.types import CheckResult, ValidationReport
from spade.queues.config import InProcessQueueConfig
from spade.queues.inprocess import InProcessQueue


def answer(name: str, *, marker: str = "", hint: str = "Think about parity.") -> str:
    """A well-formed designer answer whose env class is ``name`` (``marker`` steers the validator)."""
    code = f"import random\n\n\nclass {name}Env:\n    max_turns = 5  # {marker}\n"
    return f"```python\n{code}```\n### HINT\n{hint}\n"


def words(messages: list[dict[str, str]]) -> list[int]:
    return [len(w) for m in messages for w in m["content"].split()]


@dataclass
class ScriptedPolicy:
    """Answers from a script, in call order; an ``Exception`` entry is raised; ``delays`` per call."""

    script: list[str | Exception]
    weight_version: int = 3
    delays: list[float] = field(default_factory=list)
    prompts: list[list[int]] = field(default_factory=list)
    samplings: list[Sampling] = field(default_factory=list)
    messages: list[list[dict[str, str]]] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        self.messages.append(messages)
        return words(messages)

    async def generate(self, input_ids: list[int], sampling: Sampling) -> PolicyGeneration:
        call = len(self.prompts)
        self.prompts.append(input_ids)
        self.samplings.append(sampling)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            delay = self.delays[call] if call < len(self.delays) else 0.01
            if delay == float("inf"):
                await asyncio.Event().wait()  # never answers: only the batch deadline ends it
            await asyncio.sleep(delay)
            item = self.script[call % len(self.script)]
            if isinstance(item, Exception):
                raise item
            ids = [1000 + i for i in range(len(item.split()))]
            return PolicyGeneration(
                output_ids=ids,
                logprobs=[-0.5] * len(ids),
                finish_reason="stop",
                weight_version=self.weight_version,
                text=item,
            )
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        finally:
            self.in_flight -= 1


@dataclass
class MarkerValidator:
    """Fails the check named in a ``# fail:<check>`` marker; ``# slow`` waits for ``release`` first."""

    calls: int = 0
    release: asyncio.Event | None = None
    budgets: list[int] = field(default_factory=list)

    async def validate(self, code: str, setting: str, *, agent_max_turns: int) -> ValidationReport:
        self.calls += 1
        self.budgets.append(agent_max_turns)
        if "# slow" in code and self.release is not None:
            await self.release.wait()
        failing = code.split("# fail:")[1].split(maxsplit=1)[0] if "# fail:" in code else None
        checks = [
            CheckResult(name, name != failing, "replaying solution() did not win seed 1" if name == failing else "")
            for name in CHECK_NAMES
        ]
        return ValidationReport(
            valid=failing is None,
            setting=setting,
            env_class=code.split("class ")[1].split(":", maxsplit=1)[0],
            checks=checks,
            repaired_code=code,
        )


@dataclass
class RecordingOutbox:
    """The designer's results in publish order; ``failing`` names a publish that raises instead."""

    ready: list[EnvReady] = field(default_factory=list)
    samples: list[DesignerSample] = field(default_factory=list)
    failing: str = ""

    async def publish_env_ready(self, ready: EnvReady, *, timeout_s: float) -> None:
        if self.failing == "ready":
            raise ConnectionError("queue unreachable")
        self.ready.append(ready)

    async def publish_sample(self, sample: DesignerSample, *, timeout_s: float) -> None:
        if self.failing == "sample":
            raise ConnectionError("queue unreachable")
        self.samples.append(sample)


@pytest.fixture
def outbox() -> RecordingOutbox:
    return RecordingOutbox()


async def drain(queue: InProcessQueue, stream: str) -> list[bytes]:
    """Every message waiting on ``stream`` (consumed and acknowledged by a test consumer group)."""
    out = []
    while batch := await queue.consume(stream, "test", "t", count=100, block_ms=10):
        for d in batch:
            out.append(d.payload)
            await queue.ack(stream, "test", d.message_id)
    return out


@pytest.fixture
async def queue() -> AsyncIterator[InProcessQueue]:
    q = InProcessQueue(InProcessQueueConfig(max_len=1000, publish_timeout_s=1.0))
    yield q
    await q.close()


@pytest.fixture
def memory_service(tmp_path: Path) -> MemoryService:
    engine = make_engine(f"sqlite:///{tmp_path / 'memory.db'}")
    migrate(engine)
    return MemoryService(SqlStore(engine))


@pytest.fixture
def memory(memory_service: MemoryService) -> MemoryServiceEnvironments:
    return MemoryServiceEnvironments(memory_service)


@pytest.fixture
def documents() -> CorpusSampler:
    lines = [json.dumps({"text": f"document number {i} about graphs and parity", "id": f"doc{i}"}) for i in range(8)]
    return CorpusSampler(parse_lines(lines), seed=1)


EXAMPLE = ExampleEnv(name="CoinEnv", code="class CoinEnv:\n    max_turns = 5\n", hint="Pairs cancel out.")


def make_designer(
    config: DesignerConfig,
    policy: ScriptedPolicy,
    outbox: RecordingOutbox,
    memory: EnvironmentMemory,
    documents: CorpusSampler,
    validator: MarkerValidator | None = None,
    *,
    reachability: CriteriaReachable | None = None,
    seeds: SeedDeriver | None = None,
) -> Designer:
    """The policy designer over the test doubles, its pipeline configured like the loop."""
    pipeline = AttemptPipeline(
        PipelineConfig(
            setting=config.setting,
            spec_id=config.spec_id,
            agent_max_turns=config.budget.max_turns,
            max_new_tokens=config.sampling.max_new_tokens,
        ),
        validator=validator or MarkerValidator(),
        memory=memory,
        outbox=outbox,
        reachability=reachability,
        seeds=seeds,
    )
    return Designer(
        config, llm=policy, pipeline=pipeline, memory=memory, documents=documents, examples=[EXAMPLE], seeds=seeds
    )


@pytest.fixture
def config_for() -> Callable[..., DesignerConfig]:
    def make(**overrides: object) -> DesignerConfig:
        base: dict[str, object] = {
            "setting": "game",
            "envs_per_round": 1,
            "skills_per_round": 1,
            "max_attempts_per_env": 1,
            "concurrency": 2,
            "batch_timeout_s": 30.0,
            "sampling": Sampling(max_new_tokens=256),
            "max_prompt_tokens": 5000,
            "n_positive": 2,
            "n_negative": 1,
        }
        base.update(overrides)
        return DesignerConfig(**base)  # type: ignore[arg-type]

    return make
