"""Fixtures of the learner's unit tests: a tiny random Llama and batches for it."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from services.learner.core.batching import Role, TrainSample

VOCAB = 64


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    """A randomly initialised Llama of ~40k parameters (fast on CPU, real architecture). Its heads are 16
    wide, so the attention kernel (``spade.attention``, head dims of whole 16s) serves it where it can."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    model.config.use_cache = False
    return model


def random_batch(n: int = 6, seed: int = 1, min_len: int = 6, max_len: int = 20) -> list[TrainSample]:
    """Multi-turn-shaped samples: a prompt, then alternating trained and untrained spans."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = rng.randint(min_len, max_len)
        mask = [False] * length
        pos = rng.randint(1, 3)
        while pos < length:
            span = rng.randint(1, 4)
            for j in range(pos, min(pos + span, length)):
                mask[j] = True
            pos += span + rng.randint(0, 3)
        tokens = tuple(rng.randrange(1, VOCAB) for _ in range(length))
        # Rollout logprobs near (not equal to) what a policy would give: exercises the TIS ratio.
        lps = tuple(rng.uniform(-5.0, -3.0) if m else 0.0 for m in mask)
        role = Role.AGENT if i % 3 else Role.DESIGNER
        out.append(TrainSample(f"s{i}", role, tokens, lps, tuple(mask), 0, rng.uniform(-1.5, 1.5)))
    return out


def grouped_batch(seed: int = 0) -> list[TrainSample]:
    """Plays as an env's group gives them: members with one prompt (one with a trained token inside
    the others' shared span, one with a shorter prompt) and unrelated samples (``random_batch``)."""
    rng = random.Random(seed)
    prompt = [rng.randrange(1, VOCAB) for _ in range(24)]
    out = []
    for i in range(6):
        head = prompt[: 24 - 6 * (i == 5)]
        tail = [rng.randrange(1, VOCAB) for _ in range(rng.randint(4, 14))]
        mask = [False] * len(head) + [rng.random() < 0.7 for _ in tail]
        if i == 4:
            mask[20] = True  # trains inside the prompt: nothing from there on may be shared
        ids = tuple(head + tail)
        lps = tuple(rng.uniform(-5.0, -3.0) if m else 0.0 for m in mask)
        out.append(TrainSample(f"g{i}", Role.AGENT, ids, lps, tuple(mask), 0, rng.uniform(-1.5, 1.5)))
    return out + random_batch(n=3, seed=seed + 1)


@pytest.fixture
def model() -> LlamaForCausalLM:
    return tiny_llama()


@pytest.fixture
def batch() -> list[TrainSample]:
    return random_batch()
