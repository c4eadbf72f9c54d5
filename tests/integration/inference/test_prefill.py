"""Short prompts admitted together are prefilled in shared passes, computing what a pass alone computes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from services.inference.engine import BatchEngine, GenerationJob
from services.inference.prefill import Prompt, prefill_together
from spade.inference.protocol import SamplingParams
from tests.integration.inference.conftest import chat_ids

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is 2+2?",
    "Name three colours.",
    "Write one sentence about the sea and the wind.",
    "Hi",
    "List the first five prime numbers.",
]


@pytest.fixture(scope="module")
def idle_engine(model_dir: Path) -> Iterator[BatchEngine]:
    """An engine whose scheduler never starts: the test thread drives its admission alone."""
    eng = BatchEngine(model_dir, torch_threads=1, prefill_batch_tokens=1024)
    yield eng
    eng.close()


def _last_logprobs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)


def test_prompts_admitted_together_share_passes_and_match_a_pass_alone(idle_engine: BatchEngine) -> None:
    eng = idle_engine
    chats = [chat_ids(eng, q) for q in QUESTIONS]
    # Not a chat: nothing of it is cached, and it is longer than any chat's new part, so its row
    # feeds all of itself while the chats' rows take their start from the cached system prompt.
    text = "The quick brown fox jumps over the lazy dog, twice, and then once more."
    raw = [int(t) for t in eng.tokenizer(text)["input_ids"]]
    # A second play of the first chat: it waits for the first one's KV instead of computing it again.
    prompts = [*chats, raw, chats[0]]
    jobs = [GenerationJob(p, SamplingParams(max_new_tokens=4)) for p in prompts]
    before = eng.work.prefill_passes
    with torch.inference_mode():
        prefilled = eng._prefill_admitted(jobs)
    passes = eng.work.prefill_passes - before
    # The first chat alone (the rest share its system prompt), then the other chats and the raw text
    # in one pass or two, then the first chat's second play from the cache.
    assert passes <= 4 < len(prompts), f"{passes} passes for {len(prompts)} prompts"
    reused = [r for r, _, _ in prefilled]
    assert reused[0] == 0 and reused[len(chats)] == 0
    assert all(r > 0 for r in reused[1 : len(chats)]), "later chats did not reuse the system prompt"
    assert reused[-1] == len(chats[0]) - 1, "the repeated prompt computed more than its last token"
    for ids, (_, cache, logits) in zip(prompts, prefilled, strict=True):
        served = torch.log_softmax(logits[-1].float(), dim=-1)
        drift = (served - _last_logprobs(eng.model, ids)).abs().max().item()
        assert drift < 1e-4, f"prefill logprobs drift {drift} for {ids[-8:]}"
        assert cache.get_seq_length() == len(ids)
        # The prompt's KV went to the prefix cache: a longer prompt reuses all of it.
        assert eng.prefix_cache.match([*ids, 0])[0] == len(ids)


def test_grouped_kv_continues_a_conversation_as_a_pass_alone_would(idle_engine: BatchEngine) -> None:
    """The KV a shared pass leaves is what the next token attends to: one more token computed on it
    gives a pass-alone's logits."""
    eng = idle_engine
    eng.prefix_cache.clear()
    prompts = [chat_ids(eng, q) for q in QUESTIONS[1:4]]
    with torch.inference_mode():
        eng._prefill_admitted([GenerationJob(p, SamplingParams(max_new_tokens=1)) for p in prompts])
        for ids in prompts:
            follow = [*ids, 42]
            reused, _, logits = eng._prefill_admitted([GenerationJob(follow, SamplingParams(max_new_tokens=1))])[0]
            assert reused == len(ids)
            drift = (torch.log_softmax(logits[-1].float(), dim=-1) - _last_logprobs(eng.model, follow)).abs().max()
            assert drift.item() < 1e-4


def test_a_shared_pass_mixes_rows_with_and_without_a_cached_prefix(idle_engine: BatchEngine) -> None:
    """Both layouts of a pass: rows whose start comes from the cache beside a row without any, and
    rows none of which has a cached start."""
    eng = idle_engine
    eng.prefix_cache.clear()
    chats = [chat_ids(eng, q) for q in QUESTIONS[:3]]
    with torch.inference_mode():
        eng._prefill_admitted([GenerationJob(chats[0], SamplingParams(max_new_tokens=1))])  # caches the system prompt
        cached = [Prompt(ids, *eng.prefix_cache.match(ids)) for ids in chats[1:]]
        assert all(p.reused > 0 for p in cached)
        text = [int(t) for t in eng.tokenizer("one two three four five six seven eight nine ten " * 4)["input_ids"]]
        fresh = Prompt(text[: max(p.new for p in cached) + 3], 0, None)  # the widest row, nothing cached
        other = Prompt(text[5 : 5 + fresh.new], 0, None)
        for group in ([*cached, fresh], [fresh, other]):
            for prompt, (kv, logits) in zip(group, prefill_together(eng._forward, eng.config, group), strict=True):
                assert kv[0][0].shape[2] == len(prompt.ids)
                served = torch.log_softmax(logits[-1].float(), dim=-1)
                drift = (served - _last_logprobs(eng.model, list(prompt.ids))).abs().max().item()
                assert drift < 1e-4, f"drift {drift} for a row reusing {prompt.reused} tokens"
