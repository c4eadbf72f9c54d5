"""The shared client against the embedded server: the path designer and rollout use."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.inference.app import create_app
from services.inference.chat_completions import assistant_message
from services.inference.engine import BatchEngine
from services.inference.wiring import serve_in_thread
from spade.inference import ChatFormatter, FinishReason, InferenceClient, InferenceRequestError, SamplingParams
from tests.integration.inference.conftest import ADMIN_KEY, admin_settings, teacher_forced_logprobs

pytestmark = [pytest.mark.slow, pytest.mark.model]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "update_order",
            "description": "Change an order.",
            "parameters": {
                "type": "object",
                "properties": {"order_id": {"type": "string"}, "patch": {"type": "object"}},
                "required": ["order_id", "patch"],
            },
        },
    }
]


def _client(engine: BatchEngine, model_dir: Path, urls: list[str]) -> InferenceClient:
    app = create_app(engine)
    return InferenceClient(urls, tokenizer_path=model_dir, transports={u: httpx.ASGITransport(app=app) for u in urls})


async def test_chat_turn_token_ids_are_exactly_the_trained_ids(engine: BatchEngine, model_dir: Path) -> None:
    async with _client(engine, model_dir, ["http://w0", "http://w1"]) as client:
        await client.wait_ready(timeout_s=60)
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        turn = await client.chat(messages, SamplingParams(max_new_tokens=12, temperature=0.7))
        gen = turn.generation
        # The prompt is the model's own template, tokenised once, client-side.
        assert turn.prompt_ids == engine.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_dict=False
        )
        reference = teacher_forced_logprobs(engine.model, turn.prompt_ids, gen.output_ids, 0.7)
        assert max(abs(a - b) for a, b in zip(gen.logprobs, reference, strict=True)) < 1e-4
        assert gen.weight_version == engine.weight_version
        assert gen.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
        assert turn.tool_calls.calls == [] and turn.tool_calls.errors == []

        many = await asyncio.gather(
            *(client.generate(turn.prompt_ids, SamplingParams(max_new_tokens=3)) for _ in range(6))
        )
        assert {g.server for g in many} == {"http://w0", "http://w1"}

        infos = await client.model_info()
        assert [i.weight_version for i in infos] == [engine.weight_version] * 2

        with pytest.raises(InferenceRequestError) as info:
            await client.generate([engine.vocab_size + 5])
        assert info.value.status == 400


async def test_tools_reach_the_prompt_and_calls_are_parsed(model_dir: Path) -> None:
    formatter = ChatFormatter.from_pretrained(model_dir)
    text = formatter.render([{"role": "user", "content": "Ship order 7."}], TOOLS)
    assert '"name": "update_order"' in text and "<tool_call>" in text
    # An assistant turn with a nested-argument call and the tool's answer render back into the prompt.
    history: list[dict[str, Any]] = [
        {"role": "user", "content": "Ship order 7."},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {
                        "name": "update_order",
                        "arguments": '{"order_id": "7", "patch": {"status": "shipped"}}',
                    },
                }
            ],
        },
        {"role": "tool", "content": "order 7 shipped"},
    ]
    rendered = formatter.render(history, TOOLS)
    assert '{"name": "update_order", "arguments": {"order_id": "7", "patch": {"status": "shipped"}}}' in rendered
    assert "<tool_response>\norder 7 shipped\n</tool_response>" in rendered
    assert formatter.apply(history, TOOLS) == formatter.tokenizer(rendered, add_special_tokens=False)["input_ids"]


def test_assistant_message_reports_tool_calls_with_nested_arguments() -> None:
    call_json = '{"name": "update_order", "arguments": {"order_id": "7", "patch": {"tags": ["a", "b"]}}}'
    reply = f"Sure. <tool_call>{call_json}</tool_call>"
    message, finish = assistant_message(reply, "stop", tools_enabled=True)
    assert finish == "tool_calls" and message["content"] == "Sure."
    call = message["tool_calls"][0]
    assert call["function"]["name"] == "update_order"
    assert json.loads(call["function"]["arguments"]) == {"order_id": "7", "patch": {"tags": ["a", "b"]}}
    plain, finish = assistant_message(reply, "stop", tools_enabled=False)
    assert finish == "stop" and "tool_calls" not in plain and plain["content"] == reply


async def test_chat_completions_route(http: httpx.AsyncClient, engine: BatchEngine) -> None:
    body = {
        "model": "policy",
        "messages": [{"role": "user", "content": "Ship order 7."}],
        "tools": TOOLS,
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": True,
    }
    response = await http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    data = response.json()
    choice = data["choices"][0]
    assert data["object"] == "chat.completion" and data["metadata"]["weight_version"] == engine.weight_version
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] in {"stop", "length", "tool_calls"}
    assert data["usage"]["completion_tokens"] == len(choice["logprobs"]["content"]) > 0
    bad = await http.post("/v1/chat/completions", json={"messages": [], "max_tokens": 2})
    assert bad.status_code == 400


async def test_health_model_info_and_flush(http: httpx.AsyncClient, engine: BatchEngine) -> None:
    assert (await http.get("/health")).status_code == 200
    assert (await http.get("/health_generate")).status_code == 200
    info = (await http.get("/model_info")).json()
    assert info["weight_version"] == engine.weight_version and info["is_generation"] is True
    assert info["architectures"] == ["LlamaForCausalLM"]
    assert (await http.get("/get_model_info")).json() == info
    assert (await http.post("/flush_cache")).status_code == 200


def test_a_real_server_on_port_0(model_dir: Path) -> None:
    """Wiring + uvicorn: the same client over TCP."""
    handle = serve_in_thread(
        admin_settings(model_path=model_dir, http={"port": 0}, weight_version="5", max_batch_size=4, torch_threads=1)
    )
    try:

        async def use() -> None:
            async with InferenceClient([handle.url], tokenizer_path=model_dir, api_key=ADMIN_KEY) as client:
                await client.wait_ready(timeout_s=60)
                ids = client.apply_chat_template([{"role": "user", "content": "Hi"}])
                gen = await client.generate(ids, SamplingParams(max_new_tokens=4, temperature=0))
                assert gen.weight_version == "5" and len(gen.output_ids) <= 4
                results = await client.update_weights_from_disk(model_dir, "6")
                assert results[0].success, results[0].message
                assert (await client.generate(ids, SamplingParams(max_new_tokens=2))).weight_version == "6"

        asyncio.run(use())
    finally:
        handle.stop()
    assert not handle.engine.running


@pytest.mark.parametrize("route", ["/generate", "/v1/chat/completions"])
def test_a_request_whose_client_hangs_up_stops_decoding(model_dir: Path, route: str) -> None:
    """A cancelled caller (a designer attempt made unnecessary) must not keep the batch decoding: the
    server sees the disconnect and drops the request's rows, as SGLang aborts it."""
    handle = serve_in_thread(admin_settings(model_path=model_dir, http={"port": 0}, max_batch_size=4, torch_threads=1))
    engine = handle.engine
    try:

        async def hang_up() -> None:
            long = {"max_new_tokens": 4000, "ignore_eos": True, "temperature": 0}
            body: dict[str, Any] = (
                {"input_ids": [1, 2, 3, 4], "sampling_params": long}
                if route == "/generate"
                else {"messages": [{"role": "user", "content": "Count."}], "max_tokens": 4000, "ignore_eos": True}
            )
            async with httpx.AsyncClient(base_url=handle.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as c:
                request = asyncio.ensure_future(c.post(route, json=body, timeout=600))
                for _ in range(600):  # until the engine decodes it (a 4000-token answer takes minutes here)
                    if engine.num_running:
                        break
                    await asyncio.sleep(0.1)
                assert engine.num_running == 1
                request.cancel()  # httpx closes the connection
                await asyncio.gather(request, return_exceptions=True)
            for _ in range(300):
                if not engine.num_running:
                    break
                await asyncio.sleep(0.1)
            assert engine.num_running == 0, "the abandoned request is still decoding"

        asyncio.run(hang_up())
    finally:
        handle.stop()
