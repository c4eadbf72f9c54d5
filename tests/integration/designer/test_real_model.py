"""One designer batch with the real embedded model: SmolLM2-135M served by the in-repo SGLang-compatible
server, called through the real inference client, validated by the real sandbox.

A 135M model rarely writes a valid env; what must hold is that every attempt it makes becomes a
trainable sample carrying the exact prompt ids, its output ids with one logprob each, and the
weight version that produced them, with a named reason when it is not valid.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from services.designer.adapters import InferencePolicy, MemoryAdapter, PoolValidator
from services.designer.core.attempt import AttemptOutcome
from services.designer.core.loop import Designer, DesignerConfig
from services.designer.core.ports import Sampling
from services.designer.corpus.loader import CorpusSampler, parse_lines
from services.designer.wiring import repair
from services.inference.app import create_app
from services.inference.engine import BatchEngine
from services.inference.models import ensure_default_model
from services.memory.service import MemoryService
from services.memory.store.sql import SqlStore, make_engine, migrate
from services.sandbox.isolation import IsolationSettings, SandboxPool
from spade.envs import CHECK_NAMES, CheckConfig
from spade.inference.client import InferenceClient
from spade.queues.base import SAMPLES_DESIGNER
from spade.queues.config import InProcessQueueConfig
from spade.queues.inprocess import InProcessQueue
from spade.v1 import queues_pb2

URL = "http://inference"


@pytest.fixture
async def client() -> AsyncIterator[InferenceClient]:
    model_dir = ensure_default_model()
    engine = BatchEngine(model_dir, weight_version="0", max_batch_size=4)
    engine.start()
    transport = httpx.ASGITransport(app=create_app(engine))
    try:
        async with InferenceClient([URL], tokenizer_path=model_dir, transports={URL: transport}) as client:
            yield client
    finally:
        engine.close()


@pytest.mark.slow
async def test_every_attempt_of_the_real_model_is_a_token_exact_sample(client: InferenceClient, tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'memory.db'}")
    migrate(engine)
    queue = InProcessQueue(InProcessQueueConfig(max_len=100))
    policy = InferencePolicy(client)
    config = DesignerConfig(
        setting="game",
        envs_per_batch=1,
        max_attempts_per_env=1,
        concurrency=1,
        # Small on purpose: CPU generation on 2 shared cores is slow; the path is what is tested.
        sampling=Sampling(max_new_tokens=8, temperature=0.6),
        max_prompt_tokens=1000,
        doc_max_words=40,
        doc_min_words=20,
        n_positive=0,
        n_negative=0,
    )
    docs = [json.dumps({"text": "The greatest common divisor of two integers divides both.", "id": "gcd"})]
    async with SandboxPool(IsolationSettings()) as pool:
        designer = Designer(
            config,
            llm=policy,
            validator=PoolValidator(pool, CheckConfig(seeds=(0, 1), random_policy_episodes=5)),
            memory=MemoryAdapter(MemoryService(SqlStore(engine))),
            queue=queue,
            documents=CorpusSampler(parse_lines(docs)),
            examples=(),  # the example env alone is ~1.2k tokens; budget fitting is tested elsewhere
            repair=repair,
        )
        result = await designer.run_batch()

    assert len(result.records) == 1
    assert all(r.outcome.trainable for r in result.records), [r.error for r in result.records]
    samples = []
    while batch := await queue.consume(SAMPLES_DESIGNER, "t", "t", count=10, block_ms=10):
        samples += [queues_pb2.DesignerSample.FromString(d.payload) for d in batch]
    assert len(samples) == 1
    for record, sample in zip(
        sorted(result.records, key=lambda r: r.sample_id), sorted(samples, key=lambda s: s.sample_id), strict=True
    ):
        assert sample.sample_id == record.sample_id and sample.batch_id == result.batch_id
        assert 0 < len(sample.output_ids) <= 8
        assert len(sample.output_logprobs) == len(sample.output_ids)
        assert all(lp <= 0.0 for lp in sample.output_logprobs)
        assert sample.weight_version == 0
        assert len(sample.prompt_ids) <= 1000
        assert client.apply_chat_template(list(record.prompt_messages)) == list(sample.prompt_ids)
        if record.outcome is not AttemptOutcome.VALID:
            assert not sample.valid and sample.failed_check in (*CHECK_NAMES, "output_format", "duplicate")
    await queue.close()
