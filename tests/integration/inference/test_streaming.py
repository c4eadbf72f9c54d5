"""Streamed chat completions: SGLang's chunk sequence, reassembling to the non-streamed answer."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from services.inference.engine import BatchEngine
from tests.integration.inference.test_client_server import TOOLS

pytestmark = pytest.mark.slow


async def _stream(http: httpx.AsyncClient, body: dict[str, Any]) -> list[Any]:
    events: list[Any] = []
    async with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        async for line in response.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            payload = line[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def _content(events: list[Any], index: int = 0) -> str:
    return "".join(
        c["delta"].get("content") or ""
        for e in events
        if isinstance(e, dict)
        for c in e["choices"]
        if c["index"] == index
    )


async def test_streamed_chunks_reassemble_to_the_non_streamed_answer(
    http: httpx.AsyncClient, engine: BatchEngine
) -> None:
    body = {
        "messages": [{"role": "user", "content": "Count from 1 to 10, separated by commas."}],
        "max_tokens": 20,
        "temperature": 0,
        "logprobs": True,
        "stream_options": {"include_usage": True},
    }
    plain = (await http.post("/v1/chat/completions", json=body)).json()
    events = await _stream(http, body)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert len(chunks) > 4, "the answer was not streamed in pieces"
    assert _content(events) == plain["choices"][0]["message"]["content"]
    finish = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert [f["finish_reason"] for f in finish] == [plain["choices"][0]["finish_reason"]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == plain["usage"]
    streamed_lps = [e for c in chunks for ch in c["choices"] if ch["logprobs"] for e in ch["logprobs"]["content"]]
    plain_lps = plain["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in streamed_lps] == [e["token"] for e in plain_lps]
    # The second request reuses the first one's cached KV: equal up to float rounding.
    assert max(abs(a["logprob"] - b["logprob"]) for a, b in zip(streamed_lps, plain_lps, strict=True)) < 1e-4


async def test_a_stop_string_is_never_streamed(http: httpx.AsyncClient) -> None:
    body = {
        "messages": [{"role": "user", "content": "Count from 1 to 10, separated by commas."}],
        "max_tokens": 20,
        "temperature": 0,
    }
    full = (await http.post("/v1/chat/completions", json=body)).json()["choices"][0]["message"]["content"]
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    plain = (await http.post("/v1/chat/completions", json={**body, "stop": [stop]})).json()
    assert plain["choices"][0]["finish_reason"] == "stop"
    events = await _stream(http, {**body, "stop": [stop]})
    assert _content(events) == plain["choices"][0]["message"]["content"]
    assert stop not in _content(events)


async def test_n_streamed_choices_and_tool_calls(http: httpx.AsyncClient) -> None:
    body = {
        "messages": [{"role": "user", "content": "Say hi."}],
        "max_tokens": 6,
        "temperature": 0,
        "n": 2,
    }
    events = await _stream(http, body)
    assert _content(events, 0) == _content(events, 1) != ""  # greedy: both choices agree
    finishes = [c for e in events[:-1] for c in e["choices"] if c["finish_reason"]]
    assert sorted(c["index"] for c in finishes) == [0, 1]
    # With tools, the parsed calls arrive in one delta when the choice finishes.
    regex = r'<tool_call>\{"name": "update_order", "arguments": \{"order_id": "7", "patch": \{\}\}\}</tool_call>'
    tools_body = {
        "messages": [{"role": "user", "content": "Ship order 7."}],
        "tools": TOOLS,
        "max_tokens": 40,
        "temperature": 0,
        "regex": regex,
    }
    events = await _stream(http, tools_body)
    calls = [c["delta"]["tool_calls"] for e in events[:-1] for c in e["choices"] if c["delta"].get("tool_calls")]
    assert calls and calls[0][0]["function"]["name"] == "update_order"
    assert json.loads(calls[0][0]["function"]["arguments"]) == {"order_id": "7", "patch": {}}
    assert [c["finish_reason"] for e in events[:-1] for c in e["choices"] if c["finish_reason"]] == ["tool_calls"]
