"""The designer as a separate service (``designer_service`` wiring) with the real model.

Everything is real and reached the way distributed mode reaches it: the embedded SGLang-compatible
server with SmolLM2-135M over HTTP, the sandbox and the memory over gRPC on loopback, the run spec
stored in the memory from the designer's spec file, and the queue on the real Redis. A 135M model
rarely writes a valid env; what must hold is that its attempt becomes a sample carrying the exact
prompt ids, its output ids with one logprob each, the weight version that produced them, the spec
id, and whether the answer format was enforced, with a named reason when it is not valid.

``criteria_reachable`` asks the same model about a real tool env: the model may judge badly; what
is checked is the plumbing (the prompt reaches the server, the reply is parsed into a verdict, the
check is named and explained, and the grammar makes the verdict parseable).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from services.designer.adapters import InferencePolicy
from services.designer.core.attempt import AttemptOutcome
from services.designer.core.ports import Sampling
from services.designer.core.reachability import (
    CRITERIA_REACHABLE_CHECK,
    VERDICT_REGEX,
    CriteriaReachable,
    ReachabilityConfig,
)
from services.designer.settings import DesignerSettings
from services.designer.wiring import designer_seeds, designer_service
from services.inference.settings import InferenceSettings
from services.inference.wiring import ServerHandle, serve_in_thread
from services.memory.settings import MemorySettings
from services.memory.wiring import serving as memory_serving
from services.sandbox.settings import SandboxSettings
from services.sandbox.wiring import serving as sandbox_serving
from spade.envs import CHECK_NAMES
from spade.envs.examples import EXAMPLES
from spade.inference.client import InferenceClient
from spade.inference.models import ensure_default_model
from spade.queues.base import SAMPLES_DESIGNER
from spade.queues.config import RedisQueueConfig
from spade.queues.redis_streams import RedisStreamQueue
from spade.runspec import RunSpec
from spade.v1 import queues_pb2
from tests.conftest import REDIS_URL

pytestmark = [pytest.mark.slow, pytest.mark.model, pytest.mark.redis]


async def drop_keys(prefix: str) -> None:
    import redis.asyncio as redis

    client = redis.from_url(REDIS_URL)
    try:
        keys = [key async for key in client.scan_iter(match=f"{prefix}*")]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()


@pytest.fixture(scope="module")
def inference() -> Iterator[ServerHandle]:
    handle = serve_in_thread(
        InferenceSettings(
            model_path=ensure_default_model(), http={"port": 0}, weight_version="5", max_batch_size=4, torch_threads=1
        )
    )
    try:
        yield handle
    finally:
        handle.stop()


@pytest.fixture
async def addresses(tmp_path: Path) -> AsyncIterator[dict[str, str]]:
    memory = MemorySettings.model_validate(
        {"database_url": f"sqlite:///{tmp_path / 'm.db'}", "dev_mode": True, "grpc": {"port": 0}, "http": {"port": 0}}
    )
    sandbox = SandboxSettings.model_validate({"grpc": {"port": 0}, "http": {"port": 0}, "dev_mode": True})
    async with memory_serving(memory) as running_memory, sandbox_serving(sandbox) as running_sandbox:
        yield {
            "memory": f"127.0.0.1:{running_memory.grpc.port}",
            "sandbox": f"127.0.0.1:{running_sandbox.grpc_port}",
        }


async def test_the_wired_designer_turns_a_real_model_attempt_into_a_token_exact_sample(
    inference: ServerHandle, addresses: dict[str, str], tmp_path: Path
) -> None:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"text": "The greatest common divisor of two integers divides both."}) + "\n")
    # Small on purpose: CPU generation on 2 shared cores is the cost; the path is what is tested.
    spec = RunSpec(envs_per_round=1, skills_per_round=1, designer_max_new_tokens=32, agent_max_turns=6)
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(spec.to_json())
    queue_config = {"kind": "redis", "url": REDIS_URL, "prefix": f"test-designer-{uuid.uuid4().hex[:8]}"}
    settings = DesignerSettings.model_validate(
        {
            "dev_mode": True,
            "setting": "game",
            "max_attempts_per_env": 1,
            "max_prompt_tokens": 1000,  # the example env (~1.2k tokens) is shrunk or dropped to fit
            "doc_max_words": 40,
            "doc_min_words": 20,
            "n_positive": 0,
            "n_negative": 0,
            "corpus_path": corpus,
            "inference_urls": [inference.url],
            "tokenizer_path": inference.engine.model_path,
            "sandbox": {"target": addresses["sandbox"]},
            "memory": {"target": addresses["memory"]},
            "queue": queue_config,
            "spec_file": spec_file,
        }
    )
    async with designer_service(settings) as runtime:
        assert runtime.spec == spec and runtime.initial_version == 5
        result = await runtime.designer.run_batch(round_index=3)

    (record,) = result.records
    assert record.outcome.yields_sample, record.error
    reader = RedisStreamQueue(RedisQueueConfig.model_validate(queue_config))
    try:
        (delivery,) = await reader.consume(SAMPLES_DESIGNER, "test", "t", count=10, block_ms=1000)
        sample = queues_pb2.DesignerSample.FromString(delivery.payload)
    finally:
        await reader.close()
        await drop_keys(queue_config["prefix"])
    assert sample.sample_id == record.sample_id and sample.batch_id == result.batch_id
    assert list(sample.prompt_ids) == list(record.prompt_ids) and 0 < len(sample.prompt_ids) <= 1000
    assert 0 < len(sample.output_ids) <= 32
    assert len(sample.output_logprobs) == len(sample.output_ids)
    assert all(lp <= 0.0 for lp in sample.output_logprobs)
    assert sample.weight_version == 5 and sample.spec_id == spec.spec_id and sample.trainable
    # A 135M policy gets the answer format enforced by default, and its sample says so.
    assert sample.constrained
    assert record.text.startswith("```python"), record.text  # what the grammar allows first
    # The prompt told the model the agent's budget.
    assert "at most 6 turns" in record.prompt_messages[1]["content"]
    if record.outcome is not AttemptOutcome.VALID:
        assert not sample.valid and sample.failed_check in (*CHECK_NAMES, "output_format", "duplicate")
        assert sample.outcome in ("malformed", "duplicate", *CHECK_NAMES)


@pytest.mark.parametrize("structured", [True, False])
async def test_criteria_reachable_asks_the_real_model_and_reports_a_named_verdict(
    inference: ServerHandle, structured: bool
) -> None:
    code = EXAMPLES["clinic_scheduler"].code
    async with InferenceClient([inference.url], tokenizer_path=inference.engine.model_path) as client:
        await client.wait_ready(timeout_s=120)
        policy = InferencePolicy(client)
        config = ReachabilityConfig(
            sampling=Sampling(
                max_new_tokens=24 if structured else 12, temperature=0.3, regex=VERDICT_REGEX if structured else None
            ),
            tries=1,
            max_prompt_tokens=6000,
        )
        seeds = [designer_seeds("spec-test")(0, 0, 0, "criteria_reachable", 0)]
        check = await CriteriaReachable(policy, config).check(code, seeds=seeds)
        again = await CriteriaReachable(policy, config).check(code, seeds=seeds)

    assert check.name == CRITERIA_REACHABLE_CHECK
    assert again == check  # seeded: the same reply, so the same verdict
    kind = {
        "reachable": check.passed and "judged reachable" in check.detail,
        "unreachable": not check.passed and "judged unreachable" in check.detail,
        "unknown": not check.passed and check.detail.startswith("unknown:"),
    }
    assert sum(kind.values()) == 1, check  # exactly one explicit verdict, explained
    if structured:
        # The grammar makes the reply verdict lines (24 tokens hold at least one): never unknown.
        assert not kind["unknown"], check.detail
