"""FastAPI adapter: SGLang's HTTP API (the subset SPADE uses) over a :class:`BatchEngine`.

Routes and field names follow SGLang 0.5.x (``sglang/srt/entrypoints/http_server.py``):
``/generate``, ``/v1/chat/completions`` (with ``tools``), ``/update_weights_from_disk``, ``/health``,
``/health_generate``, ``/model_info`` (and the deprecated ``/get_model_info``), ``/get_server_info``
(and ``/server_info``), ``/flush_cache``,
``/v1/models``, plus SPADE's own ``/healthz`` and ``/metrics`` (Prometheus). Keys as in SGLang's
``--api-key`` (``Authorization: Bearer``): generation and model info need one of ``api_keys`` when
set; the admin routes (weight updates, cache flush) one of ``admin_keys``, and are off (403 for
everyone) when none is configured; another known key gets 403 there, an unknown one 401. ``/health``,
``/health_generate`` and ``/healthz`` (the bare word) are open; ``/healthz/details`` and ``/metrics``
need a key whenever any is configured. Routes translate wire
objects to engine calls and back; engine errors are domain errors of :data:`ENGINE_ERRORS`, answered
by the shared handlers of ``spade.serving.http`` in the one REST error shape
``{"error": {"code", "message"}}`` (with SGLang's 400 for an invalid request).

Differences from SGLang: one prompt per ``/generate`` request (no batched ``input_ids`` lists; ``n``
parallel samples of it are supported), no streaming on ``/generate`` (chat completions stream).
The OpenAI chat route's logic lives in :mod:`services.inference.chat_completions`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Iterator
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from services.inference.chat_completions import (
    ChatCompletionRequest,
    chat_response,
    stream_chat,
)
from services.inference.engine import (
    BatchEngine,
    EngineClosed,
    EngineFault,
    GenerationJob,
    GenerationOutcome,
    InvalidRequest,
    Overloaded,
)
from spade.auth import Forbidden, KeyRing, Principal, Role
from spade.errors import ErrorKind
from spade.inference.chat import ChatFormatError, ChatFormatter
from spade.inference.protocol import (
    SGLANG_VERSION,
    GenerateMetaInfo,
    GenerateRequest,
    GenerateResponse,
    ModelInfo,
    SamplingParams,
    ServerInfo,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDiskResponse,
)
from spade.serving.errors import ErrorKinds
from spade.serving.http import HttpMetrics, bearer_auth, install_error_handlers, ops_router

T = TypeVar("T")


class ClientHungUp(Exception):
    """The client disconnected while its request waited; nobody reads the answer."""


ENGINE_ERRORS: ErrorKinds = {
    InvalidRequest: (ErrorKind.INVALID, "invalid_request"),
    ChatFormatError: (ErrorKind.INVALID, "invalid_request"),
    Overloaded: (ErrorKind.UNAVAILABLE, "overloaded"),
    EngineClosed: (ErrorKind.UNAVAILABLE, "unavailable"),
    EngineFault: (ErrorKind.INTERNAL, "engine_fault"),
    ClientHungUp: (ErrorKind.UNAVAILABLE, "client_hung_up"),
}
"""The engine's errors as domain errors (the engine is a library of this adapter, not a ``ServiceError`` user)."""


class _EngineCollector(Collector):
    """The engine's state, read at scrape time."""

    def __init__(self, engine: BatchEngine) -> None:
        self._engine = engine

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        engine = self._engine
        yield GaugeMetricFamily("spade_inference_running", "Sequences being decoded.", value=engine.num_running)
        yield GaugeMetricFamily("spade_inference_waiting", "Requests waiting for a slot.", value=engine.num_waiting)
        yield GaugeMetricFamily("spade_inference_up", "1 while the engine runs.", value=float(engine.running))
        work = engine.work
        for name, value, doc in (
            ("busy_seconds", work.busy_s, "Scheduler time spent on work (swaps, prefills, decode steps)."),
            ("prefill_seconds", work.prefill_s, "Scheduler time spent admitting and prefilling prompts."),
            ("decode_seconds", work.decode_s, "Scheduler time spent in batched decode steps."),
            ("prefills", work.prefills, "Prompts prefilled (one per request, whatever its n)."),
            ("prefill_passes", work.prefill_passes, "Forward passes that prefilled prompts (short ones share one)."),
            ("prompt_tokens", work.prompt_tokens, "Prompt tokens computed by prefills."),
            ("cached_tokens", work.cached_tokens, "Prompt tokens reused from the prefix cache."),
            ("generated_tokens", work.generated_tokens, "Tokens generated."),
            ("decode_steps", work.decode_steps, "Decode forward passes (the batch's; the batch-invariant rows')."),
            ("decode_rows", work.decode_rows, "Sequences summed over decode steps (over decode_steps: mean batch)."),
            ("invariant_prefills", work.invariant_prefills, "Prompts prefilled in the batch-invariant mode."),
            ("invariant_steps", work.invariant_steps, "Decode passes of batch-invariant rows (in decode_steps too)."),
            ("invariant_rows", work.invariant_rows, "Batch-invariant sequences summed over those passes."),
        ):
            yield CounterMetricFamily(f"spade_inference_{name}", doc, value=value)


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


ADMIN_OFF = (
    "the admin routes are off on this server: no admin key is configured; set SPADE_INFERENCE_ADMIN_KEYS to the "
    "learner's key and restart (docs/inference.md)"
)


def admin_off() -> None:
    """The dependency of the admin routes on a server without admin keys: 403, whoever asks."""
    raise Forbidden(ADMIN_OFF)


def create_app(
    engine: BatchEngine,
    *,
    served_model_name: str | None = None,
    health_timeout_s: float = 20.0,
    keys: KeyRing[Principal] | None = None,
) -> FastAPI:
    """The HTTP app over a started ``engine`` (the caller owns the engine's lifecycle).

    Args:
        engine: The batching engine.
        served_model_name: Model name in ``/model_info`` and ``/v1`` responses.
        health_timeout_s: How long ``/health_generate`` waits for a one-token generation.
        keys: Every configured key (``InferenceSettings.keyring``): ``write`` keys generate, ``admin``
            keys also update weights and flush the cache. Generation is open unless some key is
            ``write``; the admin routes are off (403) unless some key is ``admin``. ``None``: no keys.
    """
    app = FastAPI(title="SPADE embedded inference (SGLang-compatible)", version="1")
    install_error_handlers(app, service="inference", errors=ENGINE_ERRORS, invalid_status=400)
    roles = {p.role for p in keys.principals} if keys is not None else set()
    user = [Depends(bearer_auth(keys, role=Role.WRITE, action="generating"))] if keys and Role.WRITE in roles else []
    if keys is not None and Role.ADMIN in roles:
        admin = [Depends(bearer_auth(keys, role=Role.ADMIN, action="changing the server"))]
    else:
        admin = [Depends(admin_off)]
    ops = bearer_auth(keys, role=Role.READ, action="reading the metrics") if keys is not None else None
    registry = CollectorRegistry()
    registry.register(_EngineCollector(engine))

    async def healthz() -> tuple[bool, dict[str, Any]]:
        status = "ok" if engine.running else "unavailable"
        return engine.running, {"status": status, "weight_version": str(engine.weight_version)}

    app.include_router(ops_router(health=healthz, registry=registry, guard=ops))
    app.add_middleware(HttpMetrics, service="inference", registry=registry)
    formatter = ChatFormatter(engine.tokenizer)
    model_name = served_model_name or engine.model_path.name

    @app.put("/generate", dependencies=user, operation_id="generate_put")  # one operation id per method
    @app.post("/generate", dependencies=user)
    async def generate(body: GenerateRequest, request: Request) -> Any:
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
        outcomes = await until_hung_up(request, engine.generate_n(job))
        answers = [generate_response(o, body.return_logprob).model_dump(mode="json") for o in outcomes]
        # SGLang: n > 1 turns the request into a batch, answered with a list of n results.
        return answers if job.n > 1 else answers[0]

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

    app.get("/model_info", dependencies=user)(model_info)
    app.get("/get_model_info", dependencies=user)(model_info)

    def server_info() -> dict[str, Any]:
        # SGLang answers with its ServerArgs flattened; these are the ones that mean something here.
        return ServerInfo(
            model_path=str(engine.model_path),
            enable_deterministic_inference=engine.batch_invariant,
            disable_radix_cache=engine.prefix_cache.max_tokens <= 0,
            version=f"spade-embedded (SGLang {SGLANG_VERSION} API)",
            batch_invariant_requests=True,
        ).model_dump(mode="json")

    app.get("/get_server_info", dependencies=user)(server_info)
    app.get("/server_info", dependencies=user)(server_info)

    @app.get("/flush_cache", dependencies=admin, operation_id="flush_cache_get")
    @app.post("/flush_cache", dependencies=admin)
    async def flush_cache() -> PlainTextResponse:
        if not engine.flush_cache():
            return PlainTextResponse("Flush cache failed: there are running or waiting requests.\n", status_code=400)
        return PlainTextResponse("Cache flushed.\n")

    @app.post("/update_weights_from_disk", dependencies=admin)
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

    @app.get("/v1/models", dependencies=user)
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "spade", "root": model_name}],
        }

    @app.post("/v1/chat/completions", dependencies=user)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        tools = body.tools if body.tool_choice != "none" else None
        prompt = formatter.apply(body.messages, tools)
        job = GenerationJob(input_ids=prompt, params=body.sampling(), return_logprob=body.logprobs)
        model = body.model or model_name
        if body.stream:
            job = await engine.prepare(job)  # a bad request is a 400, not an error inside a 200 stream
            return StreamingResponse(stream_chat(engine, body, job, model, bool(tools)), media_type="text/event-stream")
        outcomes = await until_hung_up(request, engine.generate_n(job))
        return chat_response(engine, body, outcomes, model, bool(tools))

    return app


#: How often a request waiting for its generation checks whether its client hung up.
HANG_UP_POLL_S = 0.5


async def until_hung_up(request: Request, work: Awaitable[T]) -> T:
    """Await ``work`` (an engine call); if the client hangs up first, cancel it and raise.

    SGLang aborts a request whose client disconnected (its tokenizer manager polls for it while the
    request waits); so does this: the engine's rows of a cancelled request are dropped at its next
    step, so an abandoned request (a designer attempt made unnecessary, a timed-out caller) stops
    costing decode steps. Streaming requests need no watch: closing the stream cancels them.

    Raises:
        ClientHungUp: The client disconnected before the generation finished.
    """
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=HANG_UP_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientHungUp("the client disconnected before its generation finished")
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
