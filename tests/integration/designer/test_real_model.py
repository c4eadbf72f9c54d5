"""The designer as a separate service (``designer_service`` wiring) with the real model.

Everything is real and reached the way distributed mode reaches it: the embedded SGLang-compatible
server with SmolLM2-135M over HTTP, the sandbox and the memory over gRPC on loopback, and the queue on
the real Redis. A 135M model rarely writes a valid env; what must hold is that its attempt becomes
a trainable sample carrying the exact prompt ids, its output ids with one logprob each and the
weight version that produced them, with a named reason when it is not valid.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from services.designer.core.attempt import AttemptOutcome
from services.designer.settings import DesignerSettings
from services.designer.wiring import designer_service
from services.inference.settings import InferenceSettings
from services.inference.wiring import ServerHandle, serve_in_thread
from services.memory.grpc_server import grpc_service
from services.memory.settings import MemorySettings
from services.memory.wiring import build_service
from services.sandbox.settings import SandboxSettings
from services.sandbox.wiring import serving
from spade.envs import CHECK_NAMES
from spade.queues.base import SAMPLES_DESIGNER
from spade.queues.config import RedisQueueConfig
from spade.queues.redis_streams import RedisStreamQueue
from spade.serving.grpc import grpc_server
from spade.serving.settings import ServerAddress
from spade.v1 import queues_pb2
from tests.conftest import REDIS_URL


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
    handle = serve_in_thread(InferenceSettings.model_validate({"port": 0, "weight_version": "5", "max_batch_size": 4}))
    try:
        yield handle
    finally:
        handle.stop()


@pytest.fixture
async def addresses(tmp_path: Path) -> AsyncIterator[dict[str, str]]:
    memory = build_service(
        MemorySettings.model_validate({"database_url": f"sqlite:///{tmp_path / 'm.db'}", "dev_mode": True})
    )
    sandbox = SandboxSettings.model_validate({"grpc": {"port": 0}, "http": {"port": 0}, "dev_mode": True})
    try:
        async with (
            grpc_server([grpc_service(memory)], ServerAddress(port=0), service="memory") as memory_grpc,
            serving(sandbox) as running,
        ):
            yield {"memory": f"127.0.0.1:{memory_grpc.port}", "sandbox": f"127.0.0.1:{running.grpc_port}"}
    finally:
        memory.store.engine.dispose()


@pytest.mark.slow
async def test_the_wired_designer_turns_a_real_model_attempt_into_a_token_exact_sample(
    inference: ServerHandle, addresses: dict[str, str], tmp_path: Path
) -> None:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"text": "The greatest common divisor of two integers divides both."}) + "\n")
    queue_config = {"kind": "redis", "url": REDIS_URL, "prefix": f"test-designer-{uuid.uuid4().hex[:8]}"}
    settings = DesignerSettings.model_validate(
        {
            "dev_mode": True,
            "setting": "game",
            "envs_per_batch": 1,
            "max_attempts_per_env": 1,
            # Small on purpose: CPU generation on 2 shared cores is the cost; the path is what is tested.
            "max_new_tokens": 8,
            "max_prompt_tokens": 1000,  # the example env (~1.2k tokens) is dropped to fit
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
        }
    )
    async with designer_service(settings) as runtime:
        result = await runtime.designer.run_batch()

    (record,) = result.records
    assert record.outcome.trainable, record.error
    reader = RedisStreamQueue(RedisQueueConfig.model_validate(queue_config))
    try:
        (delivery,) = await reader.consume(SAMPLES_DESIGNER, "test", "t", count=10, block_ms=1000)
        sample = queues_pb2.DesignerSample.FromString(delivery.payload)
    finally:
        await reader.close()
        await drop_keys(queue_config["prefix"])
    assert sample.sample_id == record.sample_id and sample.batch_id == result.batch_id
    assert list(sample.prompt_ids) == list(record.prompt_ids) and 0 < len(sample.prompt_ids) <= 1000
    assert 0 < len(sample.output_ids) <= 8
    assert len(sample.output_logprobs) == len(sample.output_ids)
    assert all(lp <= 0.0 for lp in sample.output_logprobs)
    assert sample.weight_version == 5
    if record.outcome is not AttemptOutcome.VALID:
        assert not sample.valid and sample.failed_check in (*CHECK_NAMES, "output_format", "duplicate")
