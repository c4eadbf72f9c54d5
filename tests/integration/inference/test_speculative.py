"""Prompt-lookup speculative decoding on the real SmolLM2 model: drafts are kept, and what comes out
is what plain decoding gives: the same greedy tokens, logprobs within 1e-4 of teacher forcing, stop
rules and grammars obeyed, a conversation's KV reusable afterwards."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.inference.engine import BatchEngine, GenerationJob
from spade.inference.protocol import SamplingParams
from tests.integration.inference.conftest import chat_ids, teacher_forced_logprobs
from tests.integration.inference.test_structured_output import SHORT_ANSWER, _constrained_logprobs

pytestmark = pytest.mark.slow

# A prompt whose answer re-uses its own lines, as a designer's answer re-uses the example env.
COPY = """class Board:
    def reset(self, seed):
        self.cells = [0] * 9
        self.turn = 0
        return self.observe()

    def step(self, action):
        self.cells[action] = 1
        self.turn += 1
        return self.observe(), 0.0, False, {}

Write this class out again exactly, then add a method observe() that returns the cells."""


@pytest.fixture(scope="module")
def drafting(model_dir: Path) -> Iterator[BatchEngine]:
    """An engine that drafts up to 4 tokens a row and step (the shared ``engine`` fixture does not)."""
    eng = BatchEngine(model_dir, weight_version="0", max_batch_size=16, torch_threads=1, speculative_tokens=4)
    eng.start()
    yield eng
    eng.close()


async def test_greedy_tokens_are_those_of_plain_decoding_and_drafts_are_kept(
    engine: BatchEngine, drafting: BatchEngine
) -> None:
    prompt = chat_ids(engine, COPY)
    params = SamplingParams(max_new_tokens=64, temperature=0.0)
    before = drafting.work.accepted_draft_tokens, drafting.work.decode_steps
    plain = await engine.generate(GenerationJob(prompt, params))
    drafted = await drafting.generate(GenerationJob(prompt, params))
    assert drafted.output_ids == plain.output_ids
    kept = drafting.work.accepted_draft_tokens - before[0]
    steps = drafting.work.decode_steps - before[1]
    assert kept > 16, f"only {kept} drafted tokens kept"
    assert steps + kept == len(drafted.output_ids) - 1  # every step emits its kept drafts and one token more
    reference = teacher_forced_logprobs(drafting.model, prompt, drafted.output_ids, 0.0)
    assert max(abs(a - b) for a, b in zip(drafted.output_logprobs, reference, strict=True)) < 1e-4


async def test_sampled_rows_in_one_batch_keep_teacher_forced_logprobs(drafting: BatchEngine) -> None:
    """Rows drafting different lengths (and one not at all) share a pass; each row's logprobs are a
    float32 teacher-forced pass's within 1e-4, whatever the refused drafts left in the KV."""
    settings = [
        SamplingParams(max_new_tokens=48, temperature=0.6, sampling_seed=1),
        SamplingParams(max_new_tokens=48, temperature=1.0, top_p=0.9, sampling_seed=2),
        SamplingParams(max_new_tokens=40, temperature=0.6, top_k=20, sampling_seed=3),
        SamplingParams(max_new_tokens=30, temperature=0.0),
    ]
    prompts = [chat_ids(drafting, COPY)] * 3 + [chat_ids(drafting, "Name three colours.")]
    results = await asyncio.gather(
        *(drafting.generate(GenerationJob(p, s)) for p, s in zip(prompts, settings, strict=True))
    )
    for prompt, params, out in zip(prompts, settings, results, strict=True):
        assert len(out.output_ids) <= params.max_new_tokens
        reference = teacher_forced_logprobs(drafting.model, prompt, out.output_ids, params.temperature)
        worst = max(abs(a - b) for a, b in zip(out.output_logprobs, reference, strict=True))
        assert worst < 1e-4, f"logprob drift {worst} for {params}"


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=48, temperature=0.6, sampling_seed=1234),
        SamplingParams(max_new_tokens=48, temperature=1.0, top_p=0.9, sampling_seed=99),
    ],
)
async def test_a_seeded_request_draws_the_tokens_plain_decoding_draws(
    engine: BatchEngine, drafting: BatchEngine, params: SamplingParams
) -> None:
    """Each position is sampled with the row's own generator as plain decoding samples it, and the draft
    is kept only where the draws agree with it: the same seed gives the same tokens with drafting on,
    alone or among other rows (which change how much each row may draft)."""
    prompt = chat_ids(engine, COPY)
    plain = await engine.generate(GenerationJob(prompt, params))
    kept = drafting.work.accepted_draft_tokens
    alone = await drafting.generate(GenerationJob(prompt, params))
    assert drafting.work.accepted_draft_tokens > kept, "no drafted token was kept"
    crowd = [GenerationJob(prompt, SamplingParams(max_new_tokens=40, temperature=1.0)) for _ in range(5)]
    together, *_ = await asyncio.gather(
        drafting.generate(GenerationJob(prompt, params)), *(drafting.generate(job) for job in crowd)
    )
    assert alone.output_ids == plain.output_ids
    assert together.output_ids == plain.output_ids


async def test_the_budget_and_stop_strings_cut_a_kept_draft(engine: BatchEngine, drafting: BatchEngine) -> None:
    prompt = chat_ids(engine, COPY)
    greedy = SamplingParams(max_new_tokens=64, temperature=0.0)
    full = await engine.generate(GenerationJob(prompt, greedy))
    for budget in (1, 2, 7, 13):
        out = await drafting.generate(GenerationJob(prompt, SamplingParams(max_new_tokens=budget, temperature=0.0)))
        assert out.output_ids == full.output_ids[:budget]
        assert out.finish_reason == {"type": "length", "length": budget}
    stop = str(drafting.tokenizer.decode(full.output_ids[20:22]))
    stopping = SamplingParams(max_new_tokens=64, temperature=0.0, stop=[stop])
    cut = await drafting.generate(GenerationJob(prompt, stopping))
    assert cut.finish_reason == {"type": "stop", "matched": stop}
    assert stop not in cut.text and full.text.startswith(cut.text)
    assert len(cut.output_ids) <= 22


async def test_a_grammar_still_binds_every_drafted_token(drafting: BatchEngine) -> None:
    prompt = chat_ids(drafting, "Write a game environment class and a hint.")
    params = SamplingParams(regex=SHORT_ANSWER, max_new_tokens=48, temperature=1.0, n=3, sampling_seed=5)
    for out in await drafting.generate_n(GenerationJob(prompt, params)):
        assert out.finish_reason["type"] == "stop", out.text
        assert re.fullmatch(SHORT_ANSWER, out.text), out.text
        reference = _constrained_logprobs(drafting, SHORT_ANSWER, prompt, out.output_ids, 1.0)
        assert max(abs(a - b) for a, b in zip(out.output_logprobs, reference, strict=True)) < 1e-4


async def test_the_next_turn_reuses_a_drafted_answers_kv_unchanged(drafting: BatchEngine) -> None:
    """The finished row's KV (with refused drafts masked out among it) goes to the prefix cache; the next
    turn reuses it and its logprobs are still a full teacher-forced pass's."""
    drafting.flush_cache()
    first_turn = chat_ids(drafting, COPY)
    first = await drafting.generate(GenerationJob(first_turn, SamplingParams(max_new_tokens=40, temperature=0.0)))
    history = [
        {"role": "user", "content": COPY},
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "Now the same class once more."},
    ]
    rendered = drafting.tokenizer.apply_chat_template(history, add_generation_prompt=True, return_dict=False)
    second_turn = [int(t) for t in rendered]  # type: ignore[arg-type]
    params = SamplingParams(max_new_tokens=24, temperature=0.8, sampling_seed=9)
    second = await drafting.generate(GenerationJob(second_turn, params))
    assert second.cached_tokens >= len(first_turn) + len(first.output_ids) - 2
    reference = teacher_forced_logprobs(drafting.model, second_turn, second.output_ids, 0.8)
    assert max(abs(a - b) for a, b in zip(second.output_logprobs, reference, strict=True)) < 1e-4
