"""``POST /v1/chat/completions``: OpenAI's chat shape over the engine, streamed or not.

Field names and the chunk sequence follow SGLang 0.5.23 (``entrypoints/openai/protocol.py``,
``serving_chat.py``, ``sse_utils.build_sse_content``). A streamed answer is a sequence of SSE events
``data: {chat.completion.chunk}``: per choice first a chunk with ``delta.role == "assistant"`` and
empty content, then content deltas, then a chunk with an empty delta and the ``finish_reason`` (and
``matched_stop``); with ``stream_options.include_usage`` one more chunk with ``choices: []`` and
``usage``; and finally ``data: [DONE]``. The content deltas concatenate to exactly the ``content``
of the same request answered without streaming.

With tools, tool calls can only be told apart from text once the reply is complete (the
``<tool_call>`` blocks are parsed from the whole text), so a streamed choice with tools sends its
content and ``tool_calls`` in one delta when it finishes.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from services.inference.engine import BatchEngine, FinishEvent, GenerationJob, GenerationOutcome, InvalidRequest
from services.inference.streaming import IncrementalText
from spade.inference.protocol import MAX_PARALLEL_SAMPLES, SamplingParams


class ChatCompletionRequest(BaseModel):
    """OpenAI chat completion request (the fields SGLang honours that make sense here)."""

    model_config = ConfigDict(extra="ignore")

    messages: list[dict[str, Any]] = Field(min_length=1)
    model: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = "auto"
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = None
    min_p: float | None = None
    max_tokens: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    n: int = Field(default=1, ge=1, le=MAX_PARALLEL_SAMPLES)
    logprobs: bool = False
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None
    ignore_eos: bool = False  # SGLang's extra parameter, as on /generate
    response_format: dict[str, Any] | None = None

    def json_schema(self) -> str | None:
        """The JSON schema a ``response_format`` asks for (``json_schema`` or ``json_object``)."""
        fmt = self.response_format or {}
        kind = fmt.get("type")
        if kind in (None, "text"):
            return None
        if kind == "json_object":
            return json.dumps({"type": "object"})
        if kind == "json_schema":
            schema = (fmt.get("json_schema") or {}).get("schema")
            if not isinstance(schema, dict):
                raise InvalidRequest("response_format.json_schema.schema must be a JSON schema object")
            return json.dumps(schema)
        raise InvalidRequest(f"response_format.type {kind!r} is not supported; use text, json_object or json_schema")

    def sampling(self) -> SamplingParams:
        """The engine's sampling parameters for this request."""
        values: dict[str, Any] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "max_new_tokens": self.max_completion_tokens or self.max_tokens,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "sampling_seed": self.seed,
            "n": self.n,
            "regex": self.regex,
            "ebnf": self.ebnf,
            "json_schema": self.json_schema(),
            "ignore_eos": self.ignore_eos or None,
        }
        try:
            return SamplingParams(**{k: v for k, v in values.items() if v is not None})
        except ValidationError as exc:  # a value the request's own fields let through (min_p=5, say)
            named = {"max_new_tokens": "max_tokens", "sampling_seed": "seed"}
            problems = [
                f"{'.'.join(named.get(str(p), str(p)) for p in err['loc'])}: {err['msg']}" for err in exc.errors()[:10]
            ]
            raise InvalidRequest("; ".join(problems)) from None

    @property
    def include_usage(self) -> bool:
        """Whether a streamed answer ends with a usage chunk."""
        return bool((self.stream_options or {}).get("include_usage"))


def assistant_message(text: str, finish_type: str, tools_enabled: bool) -> tuple[dict[str, Any], str]:
    """The OpenAI assistant message and ``finish_reason`` for a generated reply.

    With tools enabled, tool calls are parsed from the text (``<tool_call>`` blocks or bare JSON,
    nested arguments kept) and returned in ``tool_calls`` with JSON-string arguments, the rest of the
    text as ``content``, and ``finish_reason == "tool_calls"``.
    """
    message: dict[str, Any] = {"role": "assistant", "content": text, "reasoning_content": None}
    if not tools_enabled:
        return message, finish_type
    from spade.envs.actions import parse_tool_calls

    parsed = parse_tool_calls(text)
    if not parsed.calls:
        return message, finish_type
    message["content"] = parsed.content or None
    message["tool_calls"] = [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "index": i,
            "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)},
        }
        for i, c in enumerate(parsed.calls)
    ]
    return message, "tool_calls"


def _logprob_entries(engine: BatchEngine, ids: list[int], logprobs: list[float]) -> list[dict[str, Any]]:
    return [
        {"token": engine.tokenizer.decode([t]), "logprob": lp, "bytes": None, "top_logprobs": []}
        for t, lp in zip(ids, logprobs, strict=True)
    ]


def _usage(outcomes: list[GenerationOutcome]) -> dict[str, int]:
    # Like SGLang's UsageProcessor: the prompt counts once for the n samples of one prompt.
    prompt = outcomes[0].prompt_tokens
    completion = sum(len(o.output_ids) for o in outcomes)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def chat_response(
    engine: BatchEngine, body: ChatCompletionRequest, outcomes: list[GenerationOutcome], model: str, tools: bool
) -> dict[str, Any]:
    """The non-streamed ``chat.completion`` object for the request's ``n`` samples."""
    choices = []
    for outcome in outcomes:
        message, finish = assistant_message(outcome.text, str(outcome.finish_reason.get("type")), tools)
        choices.append(
            {
                "index": outcome.index,
                "message": message,
                "logprobs": {"content": _logprob_entries(engine, outcome.output_ids, outcome.output_logprobs)}
                if body.logprobs
                else None,
                "finish_reason": finish,
                "matched_stop": outcome.finish_reason.get("matched"),
            }
        )
    return {
        "id": outcomes[0].rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": _usage(outcomes),
        "metadata": {"weight_version": outcomes[0].weight_version},
    }


def _chunk(rid: str, created: int, model: str, choice: dict[str, Any], usage: dict[str, int] | None = None) -> str:
    chunk: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [choice] if choice else [],
        "usage": usage,
    }
    return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"


def _choice(index: int, delta: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": None, "matched_stop": None, **extra}


async def stream_chat(
    engine: BatchEngine, body: ChatCompletionRequest, job: GenerationJob, model: str, tools: bool
) -> AsyncIterator[str]:
    """The SSE events of a streamed chat completion (see the module docstring for the sequence)."""
    rid, created = job.rid, int(time.time())
    params = job.params
    texts = [
        IncrementalText(
            lambda ids: str(engine.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)),
            params.stop_strings(),
        )
        for _ in range(job.n)
    ]
    # Tokens whose logprobs went out already, per choice (logprobs travel with the content deltas).
    sent_tokens = [0] * job.n
    seen_tokens: list[list[tuple[int, float]]] = [[] for _ in range(job.n)]
    outcomes: list[GenerationOutcome] = []

    def logprobs_since(i: int, ids: list[int], lps: list[float]) -> dict[str, Any] | None:
        start, sent_tokens[i] = sent_tokens[i], len(ids)
        return {"content": _logprob_entries(engine, ids[start:], lps[start:])} if body.logprobs else None

    for index in range(job.n):
        yield _chunk(rid, created, model, _choice(index, {"role": "assistant", "content": ""}))
    # aclosing: a client that hangs up closes the engine stream at once, which cancels the request.
    async with contextlib.aclosing(engine.stream(job)) as events:
        async for event in events:
            i = event.index
            if isinstance(event, FinishEvent):
                outcome = event.outcome
                outcomes.append(outcome)
                finish = str(outcome.finish_reason.get("type"))
                delta: dict[str, Any]
                if tools:
                    message, finish = assistant_message(outcome.text, finish, True)
                    delta = {"content": message["content"]}
                    if "tool_calls" in message:
                        delta["tool_calls"] = message["tool_calls"]
                else:
                    delta = {"content": texts[i].finish(outcome.text)}
                unsent = len(outcome.output_ids) > sent_tokens[i]
                if delta.get("content") or delta.get("tool_calls") or (body.logprobs and unsent):
                    lps = logprobs_since(i, outcome.output_ids, outcome.output_logprobs)
                    yield _chunk(rid, created, model, _choice(i, delta, logprobs=lps))
                matched = outcome.finish_reason.get("matched")
                yield _chunk(rid, created, model, _choice(i, {}, finish_reason=finish, matched_stop=matched))
                continue
            seen_tokens[i].append((event.token_id, event.logprob))
            if tools:
                continue
            delta_text = texts[i].push(event.token_id)
            if delta_text:
                ids, lps_list = [t for t, _ in seen_tokens[i]], [lp for _, lp in seen_tokens[i]]
                lps = logprobs_since(i, ids, lps_list)
                yield _chunk(rid, created, model, _choice(i, {"content": delta_text}, logprobs=lps))
    if body.include_usage and outcomes:
        yield _chunk(rid, created, model, {}, usage=_usage(outcomes))
    yield "data: [DONE]\n\n"
