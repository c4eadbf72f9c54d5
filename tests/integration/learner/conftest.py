"""Fixtures of the learner's integration tests: a tiny saved checkpoint, real queues, sample makers."""

from __future__ import annotations

import random
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from services.learner.settings import LearnerSettings
from spade.queues.config import InProcessQueueConfig, RedisQueueConfig
from spade.queues.inprocess import InProcessQueue
from spade.queues.redis_streams import RedisStreamQueue
from spade.v1 import queues_pb2
from spade.v1.sandbox_pb2 import CheckResult
from tests.conftest import REDIS_URL

VOCAB = 64


@pytest.fixture
def base_model(tmp_path: Path) -> Path:
    """A randomly initialised tiny Llama saved as a HF safetensors checkpoint (+ a tokenizer file)."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
    )
    path = tmp_path / "base"
    LlamaForCausalLM(config).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the tiny model's 64 ids (built offline, no hub)."""
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2} | {f"w{i}": i for i in range(3, VOCAB)}
    tok = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
    # The embedded server needs a chat template; a minimal one suffices for weight updates.
    fast.chat_template = (
        "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w3 {% endif %}"
    )
    return fast


def make_settings(tmp_path: Path, base: Path, **overrides) -> LearnerSettings:
    values: dict[str, Any] = dict(
        model_path=base,
        checkpoint_dir=tmp_path / "ckpt",
        weights_dir=tmp_path / "weights",
        inference_urls=[],
        agent_group_size=4,
        agent_groups_per_step=1,
        fill_timeout_s=0.3,
        window_versions=2,
        checkpoint_every=1,
        lr=1e-3,
        temperature=1.0,
        device="cpu",
        retry={"attempts": 3, "initial_s": 0.01, "max_s": 0.04, "jitter_s": 0.0},
    )
    values.update(overrides)
    return LearnerSettings(**values)


def agent_sample(
    sid: str, env: str, seed: int, ret: float, version: int = 0, hinted: bool = False, group: str | None = None
) -> queues_pb2.AgentSample:
    rng = random.Random(sid)
    n = rng.randint(8, 14)
    mask = [False, False, False] + [rng.random() < 0.7 for _ in range(n - 3)]
    mask[-1] = True
    return queues_pb2.AgentSample(
        sample_id=sid,
        env_id=env,
        setting="game",
        skill="Mathematical Reasoning",
        seed=seed,
        hinted=hinted,
        group_id=group or f"{env}@{version}",
        token_ids=[rng.randrange(1, VOCAB) for _ in range(n)],
        logprobs=[rng.uniform(-4.5, -3.5) if m else 0.0 for m in mask],
        loss_mask=mask,
        episode_return=ret,
        turns=2,
        weight_version=version,
        finish_reason="terminated",
    )


def designer_sample(
    sid: str, env: str, version: int = 0, valid: bool = True, skill: str = "Mathematical Reasoning", batch: str = "b0"
) -> queues_pb2.DesignerSample:
    rng = random.Random(sid)
    out = [rng.randrange(1, VOCAB) for _ in range(10)]
    return queues_pb2.DesignerSample(
        sample_id=sid,
        env_id=env if valid else "",
        setting="game",
        skill=skill,
        prompt_ids=[rng.randrange(1, VOCAB) for _ in range(6)],
        output_ids=out,
        output_logprobs=[rng.uniform(-4.5, -3.5) for _ in out],
        weight_version=version,
        valid=valid,
        failed_check="" if valid else "smoke",
        checks=[CheckResult(name="syntax", passed=True), CheckResult(name="smoke", passed=valid)],
        batch_id=batch,
    )


@pytest.fixture
async def inprocess_queue() -> AsyncIterator[InProcessQueue]:
    queue = InProcessQueue(InProcessQueueConfig(claim_idle_ms=200))
    yield queue
    await queue.close()


@pytest.fixture
async def redis_queue() -> AsyncIterator[RedisStreamQueue]:
    config = RedisQueueConfig(url=REDIS_URL, prefix=f"test-learner-{uuid.uuid4().hex[:8]}:", claim_idle_ms=200)
    queue = RedisStreamQueue(config)
    yield queue
    await queue.delete_all()
    await queue.close()
