"""FastAPI adapter: SGLang's HTTP API (the subset SPADE uses) over a :class:`BatchEngine`.

Routes and field names follow SGLang 0.5.x (``sglang/srt/entrypoints/http_server.py``):
``/generate``, ``/v1/chat/completions`` (with ``tools``), ``/update_weights_from_disk``, ``/health``,
``/health_generate``, ``/model_info`` (and the deprecated ``/get_model_info``), ``/flush_cache``,
``/v1/models``. Routes translate wire objects to engine calls and back; engine errors map to HTTP
statuses in :func:`_install_error_handlers`, the one place that does so.

Differences from SGLang: one prompt per ``/generate`` request (no batched ``input_ids`` lists), no
streaming, a simple LRU prefix cache instead of a radix tree (``/flush_cache`` clears it when idle),
``n == 1`` in chat completions.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from services.inference.engine import (
    BatchEngine,
    EngineClosed,
    EngineFault,
    GenerationJob,
    GenerationOutcome,
    InvalidRequest,
    Overloaded,
)
from spade.inference.chat import ChatFormatError, ChatFormatter
from spade.inference.protocol import (
    GenerateMetaInfo,
    GenerateRequest,
    GenerateResponse,
    ModelInfo,
    SamplingParams,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDiskResponse,
)


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
    n: Literal[1] = 1
    logprobs: bool = False
    stream: Literal[False] = False

    def sampling(self) -> SamplingParams:
        values: dict[str, Any] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "max_new_tokens": self.max_completion_tokens or self.max_tokens,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "sampling_seed": self.seed,
        }
        return SamplingParams(**{k: v for k, v in values.items() if v is not None})


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def _install_error_handlers(app: FastAPI) -> None:
    """Map domain errors to HTTP statuses, in one place; never send a traceback."""

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ())[1:]) or 'body'}: {e.get('msg')}" for e in exc.errors()
        )
        return _error(400, f"invalid request: {problems}")

    @app.exception_handler(InvalidRequest)
    async def _bad(_: Request, exc: InvalidRequest) -> JSONResponse:
        return _error(400, str(exc))

    @app.exception_handler(ChatFormatError)
    async def _bad_chat(_: Request, exc: ChatFormatError) -> JSONResponse:
        return _error(400, str(exc))

    @app.exception_handler(Overloaded)
    async def _busy(_: Request, exc: Overloaded) -> JSONResponse:
        return _error(503, f"server overloaded: {exc}; retry with backoff", "overloaded")

    @app.exception_handler(EngineClosed)
    async def _closed(_: Request, exc: EngineClosed) -> JSONResponse:
        return _error(503, str(exc), "unavailable")

    @app.exception_handler(EngineFault)
    async def _fault(_: Request, exc: EngineFault) -> JSONResponse:
        return _error(500, str(exc), "internal_error")


def generate_response(outcome: GenerationOutcome, return_logprob: bool) -> GenerateResponse:
    """Build SGLang's ``/generate`` response from an engine outcome."""
    meta = GenerateMetaInfo(
        id=outcome.rid,
        finish_reason=outcome.finish_reason,
        prompt_tokens=outcome.prompt_tokens,
        completion_tokens=len(outcome.output_ids),
        cached_tokens=outcome.cached_tokens,
        weight_version=outcome.weight_version,
        e2e_latency=outcome.latency_s,
    )
    if return_logprob:
        meta.output_token_logprobs = [
            (lp, tok, None) for lp, tok in zip(outcome.output_logprobs, outcome.output_ids, strict=True)
        ]
        meta.input_token_logprobs = [(lp, tok, None) for lp, tok in outcome.input_logprobs]
    return GenerateResponse(text=outcome.text, output_ids=outcome.output_ids, meta_info=meta)


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


def create_app(engine: BatchEngine, *, served_model_name: str | None = None, health_timeout_s: float = 20.0) -> FastAPI:
    """The HTTP app over a started ``engine`` (the caller owns the engine's lifecycle)."""
    app = FastAPI(title="SPADE embedded inference (SGLang-compatible)", version="1")
    _install_error_handlers(app)
    formatter = ChatFormatter(engine.tokenizer)
    model_name = served_model_name or engine.model_path.name

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(body: GenerateRequest) -> dict[str, Any]:
        if body.stream:
            raise InvalidRequest("streaming is not supported by the embedded server; send stream=false")
        if body.input_ids is not None:
            input_ids = body.input_ids
        else:
            input_ids = [int(t) for t in engine.tokenizer(body.text or "", add_special_tokens=False)["input_ids"]]
            if not input_ids:
                raise InvalidRequest("text tokenises to no tokens; send a non-empty prompt")
        job = GenerationJob(
            input_ids=input_ids,
            params=body.sampling_params,
            return_logprob=body.return_logprob,
            logprob_start_len=body.logprob_start_len,
            rid=body.rid or uuid.uuid4().hex,
        )
        outcome = await engine.generate(job)
        return generate_response(outcome, body.return_logprob).model_dump(mode="json")

    @app.get("/health")
    async def health() -> PlainTextResponse:
        return PlainTextResponse("", status_code=200 if engine.running else 503)

    @app.get("/health_generate")
    async def health_generate() -> PlainTextResponse:
        # Like SGLang: a busy server that keeps making progress is healthy without extra work.
        if engine.num_running and time.monotonic() - engine.last_progress < health_timeout_s:
            return PlainTextResponse("", status_code=200)
        job = GenerationJob(input_ids=[0], params=SamplingParams(max_new_tokens=1, temperature=0.0))
        try:
            await asyncio.wait_for(engine.generate(job), timeout=health_timeout_s)
        except (TimeoutError, EngineClosed, EngineFault, Overloaded):
            return PlainTextResponse("", status_code=503)
        return PlainTextResponse("", status_code=200)

    def model_info() -> dict[str, Any]:
        config = engine.config
        return ModelInfo(
            model_path=str(engine.model_path),
            served_model_name=model_name,
            tokenizer_path=str(engine.tokenizer_path),
            is_generation=True,
            preferred_sampling_params=None,
            weight_version=engine.weight_version,
            model_type=getattr(config, "model_type", None),
            architectures=getattr(config, "architectures", None),
        ).model_dump(mode="json")

    app.get("/model_info")(model_info)
    app.get("/get_model_info")(model_info)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> PlainTextResponse:
        if not engine.flush_cache():
            return PlainTextResponse("Flush cache failed: there are running or waiting requests.\n", status_code=400)
        return PlainTextResponse("Cache flushed.\n")

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: UpdateWeightsFromDiskRequest) -> JSONResponse:
        if body.load_format not in (None, "auto", "safetensors"):
            raise InvalidRequest(f"load_format={body.load_format!r} is not supported; use 'auto' or omit it")
        outcome = await engine.update_weights(
            body.model_path, body.weight_version, abort_all_requests=body.abort_all_requests
        )
        content = UpdateWeightsFromDiskResponse(
            success=outcome.success, message=outcome.message, num_paused_requests=outcome.num_paused_requests
        )
        return JSONResponse(content.model_dump(mode="json"), status_code=200 if outcome.success else 400)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "spade", "root": model_name}],
        }

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest) -> dict[str, Any]:
        tools = body.tools if body.tool_choice != "none" else None
        prompt = formatter.apply(body.messages, tools)
        job = GenerationJob(input_ids=prompt, params=body.sampling(), return_logprob=body.logprobs)
        outcome = await engine.generate(job)
        message, finish = assistant_message(outcome.text, str(outcome.finish_reason.get("type")), bool(tools))
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "logprobs": None,
            "finish_reason": finish,
            "matched_stop": outcome.finish_reason.get("matched"),
        }
        if body.logprobs:
            choice["logprobs"] = {
                "content": [
                    {"token": engine.tokenizer.decode([t]), "logprob": lp, "bytes": None, "top_logprobs": []}
                    for t, lp in zip(outcome.output_ids, outcome.output_logprobs, strict=True)
                ]
            }
        return {
            "id": outcome.rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.model or model_name,
            "choices": [choice],
            "usage": {
                "prompt_tokens": outcome.prompt_tokens,
                "completion_tokens": len(outcome.output_ids),
                "total_tokens": outcome.prompt_tokens + len(outcome.output_ids),
            },
            "metadata": {"weight_version": outcome.weight_version},
        }

    return app
