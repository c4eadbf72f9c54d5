"""/generate on the real SmolLM2 model: logprob fidelity, batching, stop rules, errors."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from services.inference.engine import BatchEngine, GenerationJob
from spade.inference.protocol import SamplingParams
from tests.integration.inference.conftest import chat_ids, teacher_forced_logprobs

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is 2+2?",
    "Name three colours.",
    "Write one sentence about the sea and the wind.",
    "Hi",
    "List the first five prime numbers.",
    "Explain gravity in a few words.",
]


async def test_logprobs_match_teacher_forcing_under_batching_and_sampling(
    http: httpx.AsyncClient, engine: BatchEngine
) -> None:
    """Concurrent requests with different sampling settings are batched together, and every returned
    logprob equals a float32 teacher-forced forward pass over the same tokens within 1e-4."""
    settings: list[dict[str, Any]] = [
        {"temperature": 0.0},
        {"temperature": 1.0},
        {"temperature": 0.7, "top_p": 0.9},
        {"temperature": 1.3, "top_k": 20},
        {"temperature": 0.6, "min_p": 0.05},
        {"temperature": 1.0, "sampling_seed": 7},
    ]
    prompts = [chat_ids(engine, p) for p in PROMPTS]
    peak_before = engine.peak_batch_rows

    async def one(prompt: list[int], sp: dict[str, Any]) -> dict:
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 12, **sp}, "return_logprob": True}
        response = await http.post("/generate", json=body)
        assert response.status_code == 200, response.text
        return response.json()

    results = await asyncio.gather(*(one(p, s) for p, s in zip(prompts, settings, strict=True)))
    assert engine.peak_batch_rows >= 2 or peak_before >= 2, "concurrent requests were never decoded together"
    for prompt, sp, body in zip(prompts, settings, results, strict=True):
        meta = body["meta_info"]
        output = body["output_ids"]
        assert output, "no tokens generated"
        assert [t for _, t, _ in meta["output_token_logprobs"]] == output
        served = [lp for lp, _, _ in meta["output_token_logprobs"]]
        reference = teacher_forced_logprobs(engine.model, prompt, output, float(sp["temperature"]))
        worst = max(abs(a - b) for a, b in zip(served, reference, strict=True))
        assert worst < 1e-4, f"logprob drift {worst} for {sp}: {served} vs {reference}"
        assert meta["completion_tokens"] == len(output)
        assert meta["prompt_tokens"] == len(prompt)
        assert meta["weight_version"] == engine.weight_version


async def test_greedy_output_is_the_same_alone_and_in_a_batch(engine: BatchEngine) -> None:
    """Batching must not change what a sequence generates: greedy alone == greedy among others."""
    prompt = chat_ids(engine, PROMPTS[2])
    params = SamplingParams(max_new_tokens=10, temperature=0.0)
    alone = await engine.generate(GenerationJob(prompt, params))
    crowd = [GenerationJob(chat_ids(engine, p), SamplingParams(max_new_tokens=16, temperature=1.0)) for p in PROMPTS]
    together = await asyncio.gather(
        engine.generate(GenerationJob(prompt, params)), *(engine.generate(j) for j in crowd)
    )
    assert together[0].output_ids == alone.output_ids
    assert together[0].text == alone.text


async def test_seeded_sampling_is_reproducible(engine: BatchEngine) -> None:
    prompt = chat_ids(engine, PROMPTS[1])
    params = SamplingParams(max_new_tokens=8, temperature=1.0, sampling_seed=1234)
    first, second = await asyncio.gather(
        engine.generate(GenerationJob(prompt, params)), engine.generate(GenerationJob(prompt, params))
    )
    assert first.output_ids == second.output_ids


async def test_finish_reasons_and_stop_rules(http: httpx.AsyncClient, engine: BatchEngine) -> None:
    prompt = chat_ids(engine, "Count from 1 to 20, separated by commas.")
    greedy: dict[str, Any] = {"temperature": 0.0, "max_new_tokens": 16}
    base = (await http.post("/generate", json={"input_ids": prompt, "sampling_params": greedy})).json()
    assert base["meta_info"]["finish_reason"] == {"type": "length", "length": 16}
    assert "output_token_logprobs" not in base["meta_info"] or base["meta_info"]["output_token_logprobs"] is None

    # A stop token id: generation ends on it, and the id is kept as the last output token.
    stop_id = base["output_ids"][3]
    body = {"input_ids": prompt, "sampling_params": greedy | {"stop_token_ids": [stop_id]}}
    stopped = (await http.post("/generate", json=body)).json()
    assert stopped["output_ids"] == base["output_ids"][: base["output_ids"].index(stop_id) + 1]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}

    # A stop string: generation ends once it appears, and the text is cut before it.
    stop_text = str(engine.tokenizer.decode(base["output_ids"][5:7]))
    body = {"input_ids": prompt, "sampling_params": greedy | {"stop": [stop_text]}}
    cut = (await http.post("/generate", json=body)).json()
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_text}
    assert stop_text not in cut["text"]
    assert base["text"].startswith(cut["text"])
    assert len(cut["output_ids"]) <= 7

    # max_new_tokens 0: nothing generated, still a well-formed answer.
    empty = (await http.post("/generate", json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 0}})).json()
    assert empty["output_ids"] == [] and empty["meta_info"]["finish_reason"]["type"] == "length"


async def test_eos_ends_generation_and_is_returned(engine: BatchEngine) -> None:
    """The model's EOS (<|im_end|>) ends a reply and is part of the trained tokens."""
    prompt = chat_ids(engine, "What is the capital of France?")
    out = await engine.generate(GenerationJob(prompt, SamplingParams(max_new_tokens=16, temperature=0.0)))
    assert out.finish_reason == {"type": "stop", "matched": engine.eos_ids[0]}
    assert out.output_ids[-1] == engine.eos_ids[0]
    assert "<|im_end|>" not in out.text


async def test_input_logprobs_match_teacher_forcing(http: httpx.AsyncClient, engine: BatchEngine) -> None:
    prompt = chat_ids(engine, PROMPTS[0])
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": 1},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    meta = (await http.post("/generate", json=body)).json()["meta_info"]
    inputs = meta["input_token_logprobs"]
    assert [t for _, t, _ in inputs] == prompt
    assert inputs[0][0] is None
    reference = teacher_forced_logprobs(engine.model, prompt[:1], prompt[1:], 0.0)
    assert max(abs(a[0] - b) for a, b in zip(inputs[1:], reference, strict=True)) < 1e-4


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"input_ids": [], "sampling_params": {}}, "input_ids"),
        ({"input_ids": [10**7], "sampling_params": {}}, "outside the vocabulary"),
        ({"input_ids": [1] * 9000, "sampling_params": {}}, "context length"),
        ({"input_ids": [1, 2], "sampling_params": {"temperature": -1}}, "temperature"),
        ({"input_ids": [1, 2], "sampling_params": {"top_k": 0}}, "top_k"),
        ({"input_ids": [1, 2], "stream": True}, "streaming"),
        ({"sampling_params": {}}, "exactly one of input_ids"),
        ({"input_ids": [1], "text": "hi"}, "exactly one of input_ids"),
    ],
)
async def test_bad_requests_get_400_with_the_reason(http: httpx.AsyncClient, body: dict, needle: str) -> None:
    response = await http.post("/generate", json=body)
    assert response.status_code == 400
    assert needle in response.json()["error"]["message"]


async def test_a_text_prompt_is_tokenised_by_the_server(http: httpx.AsyncClient, engine: BatchEngine) -> None:
    text = "The capital of France is"
    body = {"text": text, "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    by_text = (await http.post("/generate", json=body)).json()
    ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    by_ids = (await http.post("/generate", json=body)).json()
    assert by_text["output_ids"] == by_ids["output_ids"]
    assert by_text["meta_info"]["prompt_tokens"] == len(ids)


async def test_a_full_queue_answers_503(http: httpx.AsyncClient, engine: BatchEngine) -> None:
    limit = engine.max_waiting
    engine.max_waiting = 0  # every new request finds the queue full
    try:
        response = await http.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}})
        assert response.status_code == 503
        assert "max_waiting" in response.json()["error"]["message"]
    finally:
        engine.max_waiting = limit
    response = await http.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}})
    assert response.status_code == 200


async def test_a_repeated_prefix_is_reused_without_changing_the_result(
    http: httpx.AsyncClient, engine: BatchEngine
) -> None:
    """A multi-turn conversation resends its history: the second turn prefills only the new tokens,
    and its tokens and logprobs are still those of a full teacher-forced pass."""
    assert (await http.post("/flush_cache")).status_code == 200
    first_turn = chat_ids(engine, "Name a fruit.")
    body = {"input_ids": first_turn, "sampling_params": {"max_new_tokens": 6, "temperature": 0}, "return_logprob": True}
    first = (await http.post("/generate", json=body)).json()
    assert first["meta_info"]["cached_tokens"] == 0
    history = [
        {"role": "user", "content": "Name a fruit."},
        {"role": "assistant", "content": first["text"]},
        {"role": "user", "content": "And a vegetable?"},
    ]
    rendered = engine.tokenizer.apply_chat_template(history, add_generation_prompt=True, return_dict=False)
    second_turn = [int(t) for t in rendered]  # type: ignore[arg-type]
    body = {
        "input_ids": second_turn,
        "sampling_params": {"max_new_tokens": 6, "temperature": 0.8},
        "return_logprob": True,
    }
    second = (await http.post("/generate", json=body)).json()
    assert second["meta_info"]["cached_tokens"] >= len(first_turn) - 1
    served = [lp for lp, _, _ in second["meta_info"]["output_token_logprobs"]]
    reference = teacher_forced_logprobs(engine.model, second_turn, second["output_ids"], 0.8)
    assert max(abs(a - b) for a, b in zip(served, reference, strict=True)) < 1e-4
    # Flushing forgets it.
    assert (await http.post("/flush_cache")).status_code == 200
    again = (await http.post("/generate", json=body)).json()
    assert again["meta_info"]["cached_tokens"] == 0
