"""The inference client: token-in/token-out generation against SGLang or the embedded server.

One client talks to one or more servers (one URL per inference worker) through SGLang's native
``/generate``. Prompts go in as token ids (the chat template is applied here, with the model's own
tokenizer), and the sampled token ids come back with their logprobs, the finish reason and the
``weight_version`` that produced them, which is everything a trainable sample needs.

Behaviour on failure: 5xx answers, 429, connection errors and timeouts are retried under the client's
:class:`spade.retry.RetryPolicy` (exponential back-off with jitter), preferring another worker; 4xx
answers are the caller's mistake and raise :class:`InferenceRequestError` at once. Concurrency is
bounded per client.

Example::

    async with InferenceClient(["http://127.0.0.1:30000"], tokenizer_path=ckpt) as client:
        await client.wait_ready()
        ids = client.apply_chat_template([{"role": "user", "content": "2+2?"}])
        gen = await client.generate(ids, SamplingParams(max_new_tokens=16, temperature=0.6))
        gen.output_ids, gen.logprobs, gen.finish_reason, gen.weight_version
"""

from __future__ import annotations

import asyncio
import copy
import enum
import itertools
import ssl
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import httpx

from spade.errors import Unavailable
from spade.inference.chat import ChatFormatter, Message
from spade.inference.protocol import (
    GenerateRequest,
    GenerateResponse,
    ModelInfo,
    SamplingParams,
    ServerInfo,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDiskResponse,
)
from spade.retry import RetryPolicy
from spade.serving.logs import get_logger
from spade.serving.tls import ClientTls

if TYPE_CHECKING:
    from spade.envs.actions import ToolCallParse

logger = get_logger(__name__)


class FinishReason(enum.StrEnum):
    """Why a generation ended (SGLang's ``finish_reason.type``)."""

    STOP = "stop"  # an EOS/stop token or stop string was produced
    LENGTH = "length"  # max_new_tokens or the context length was reached
    ABORT = "abort"  # the server aborted the request (e.g. a weight update with abort_all_requests)


class InferenceError(RuntimeError):
    """Base class of the client's errors."""


class InferenceRequestError(InferenceError):
    """The server rejected the request (4xx): fix the request, retrying will not help."""

    def __init__(self, url: str, status: int, detail: str) -> None:
        super().__init__(f"{url} rejected the request with HTTP {status}: {detail}")
        self.url, self.status, self.detail = url, status, detail


class InferenceUnavailable(InferenceError, Unavailable):
    """No server answered successfully within the retry budget."""


class _Transient(InferenceError):
    """One try failed for a reason worth another (5xx, 429, connection error, timeout)."""


DEFAULT_RETRY = RetryPolicy(attempts=5, initial_s=0.5, multiplier=2.0, max_s=10.0, jitter_s=0.25)
"""Tries of one request on transient failures (each try prefers a worker not yet tried)."""


@dataclass(frozen=True)
class Generation:
    """One completion, token-aligned.

    Attributes:
        output_ids: sampled token ids, including a final EOS/stop token when one was produced.
        logprobs: one logprob per output id, of the sampling distribution (SGLang's convention:
            ``log_softmax(logits / temperature)``, before top-p/top-k; raw logits when greedy).
        finish_reason: why generation stopped.
        weight_version: the weights that produced every token of this completion.
        text: the detokenised output (special tokens skipped, a matched stop string trimmed).
        matched_stop: the stop token id or stop string that ended it, if any.
        prompt_tokens: prompt length the server saw.
        server: the URL that served it.
    """

    output_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    weight_version: str | None
    text: str
    matched_stop: int | str | None = None
    prompt_tokens: int = 0
    server: str = ""

    @classmethod
    def from_response(cls, body: GenerateResponse, server: str = "") -> Generation:
        """Build from a ``/generate`` response (raises :class:`InferenceError` if it is inconsistent)."""
        meta = body.meta_info
        reason = meta.finish_reason or {"type": "abort", "message": "no finish_reason"}
        logprobs = [float(lp) for lp, _, _ in (meta.output_token_logprobs or [])]
        if meta.output_token_logprobs is not None:
            ids = [int(t) for _, t, _ in meta.output_token_logprobs]
            if ids != body.output_ids:
                raise InferenceError(f"{server}: output_token_logprobs do not match output_ids")
        return cls(
            output_ids=list(body.output_ids),
            logprobs=logprobs,
            finish_reason=FinishReason(reason.get("type", "abort")),
            weight_version=meta.weight_version,
            text=body.text,
            matched_stop=reason.get("matched"),
            prompt_tokens=meta.prompt_tokens,
            server=server,
        )


@dataclass(frozen=True)
class ChatGeneration:
    """A chat turn: the prompt ids sent, the completion, and the tool calls found in its text."""

    prompt_ids: list[int]
    generation: Generation
    tool_calls: ToolCallParse


@dataclass(frozen=True)
class WeightUpdateResult:
    """The outcome of ``/update_weights_from_disk`` on one worker."""

    url: str
    success: bool
    message: str
    num_paused_requests: int = 0


@dataclass
class _Worker:
    url: str
    http: httpx.AsyncClient
    in_flight: int = 0
    failures: int = field(default=0)


class InferenceClient:
    """Async client for one or more SGLang-compatible servers.

    Args:
        urls: base URLs, one per inference worker (``http://host:port``).
        tokenizer_path: the model's checkpoint directory, for :meth:`apply_chat_template`; optional
            when only token ids are used.
        max_concurrency: most requests in flight from this client, over all workers.
        timeout_s: per-request read timeout (a generation can take a while).
        connect_timeout_s: connection timeout.
        retry: tries of one request on 5xx/429/connection errors/timeouts, and the back-off between.
        transports: optional ``{url: transport}`` (e.g. ``httpx.ASGITransport`` for an in-process
            server); URLs not listed use the network.
        api_key: sent as ``Authorization: Bearer <key>`` on every request (SGLang's ``--api-key``, the
            embedded server's ``api_keys``/``admin_keys``); ``None``: no header.
        tls: for ``https://`` workers: the CA that signed their certificates and, for mutual TLS, this
            client's certificate; ``None``: the system's CAs.
    """

    def __init__(
        self,
        urls: Sequence[str] | str,
        tokenizer_path: str | Path | None = None,
        *,
        max_concurrency: int = 64,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 10.0,
        retry: RetryPolicy = DEFAULT_RETRY,
        transports: Mapping[str, httpx.AsyncBaseTransport] | None = None,
        api_key: str | None = None,
        tls: ClientTls | None = None,
    ) -> None:
        url_list = [urls] if isinstance(urls, str) else list(urls)
        if not url_list:
            raise ValueError("InferenceClient needs at least one server URL, e.g. http://127.0.0.1:30000")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        transports = dict(transports or {})
        timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s)
        self._timeout = timeout
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._verify: ssl.SSLContext | bool = tls.ssl_context() if tls is not None else True
        self._retired: list[_Worker] = []
        self._workers = [
            _Worker(url=u.rstrip("/"), http=self._http(u, transports.get(u.rstrip("/")))) for u in url_list
        ]
        self._semaphore = asyncio.Semaphore(max_concurrency)
        self._retry = retry
        self._rr = itertools.count()
        self._formatter: ChatFormatter | None = (
            ChatFormatter.from_pretrained(tokenizer_path) if tokenizer_path is not None else None
        )
        self._batch_invariant = False

    def batch_invariant(self) -> InferenceClient:
        """A view of this client whose every generation asks for the batch-invariant mode.

        Each request it sends carries ``sampling_params.custom_params.batch_invariant = true``, which
        the embedded server honours per request (the reply does not depend on what else is in
        flight; docs/inference.md) and SGLang accepts and ignores (there, only the server's
        ``--enable-deterministic-inference`` makes replies batch-invariant; :meth:`server_info`
        tells). The view shares this client's workers, connections, concurrency bound and
        tokenizer: closing either closes both. For code that builds its own :class:`SamplingParams`
        (the rollout's episode loop) but should ask for the mode (the eval).
        """
        view = copy.copy(self)
        view._batch_invariant = True
        return view

    @property
    def urls(self) -> list[str]:
        """The workers' base URLs."""
        return [w.url for w in self._workers]

    def set_urls(self, urls: Sequence[str]) -> None:
        """Serve from ``urls`` from now on (inference discovery calls this as workers come and go).

        Workers still listed keep their connections and counters; requests in flight on a removed
        worker finish there (its connections close with the client). An empty list is ignored: a
        client always has somewhere to send.
        """
        wanted = [u.rstrip("/") for u in urls]
        if not wanted:
            return
        known = {w.url: w for w in self._workers}
        # In place: a batch_invariant() view shares these lists.
        self._retired.extend(w for u, w in known.items() if u not in wanted)
        self._workers[:] = [known.get(u) or _Worker(url=u, http=self._http(u)) for u in wanted]

    def _http(self, url: str, transport: httpx.AsyncBaseTransport | None = None) -> httpx.AsyncClient:
        """The HTTP client of one worker: its base URL, the timeouts, the key and the TLS settings."""
        return httpx.AsyncClient(
            base_url=url.rstrip("/"),
            timeout=self._timeout,
            transport=transport,
            headers=self._headers,
            verify=self._verify,
        )

    async def __aenter__(self) -> InferenceClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the HTTP connections."""
        for w in [*self._workers, *self._retired]:
            await w.http.aclose()

    # -- chat formatting ---------------------------------------------------------------------------

    @property
    def formatter(self) -> ChatFormatter:
        """The chat formatter (needs ``tokenizer_path``)."""
        if self._formatter is None:
            raise InferenceError("this client has no tokenizer; pass tokenizer_path=<checkpoint dir>")
        return self._formatter

    def apply_chat_template(
        self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> list[int]:
        """Prompt token ids for ``messages`` (and OpenAI ``tools``), ending with the assistant header."""
        return self.formatter.apply(messages, tools)

    # -- requests ------------------------------------------------------------------------------------

    def _pick(self, avoid: set[str]) -> _Worker:
        candidates = [w for w in self._workers if w.url not in avoid] or self._workers
        least = min(w.in_flight for w in candidates)
        tied = [w for w in candidates if w.in_flight == least]
        return tied[next(self._rr) % len(tied)]

    async def _request(
        self, method: str, path: str, *, json: Any = None, worker: _Worker | None = None
    ) -> tuple[_Worker, httpx.Response]:
        """Send with retries; returns the worker that answered and its 2xx response."""
        tried: set[str] = set()
        try:
            async for attempt in self._retry.async_retrying(_Transient, logger=logger, what=f"inference {path}"):
                with attempt:
                    return await self._try(method, path, json, worker or self._pick(tried), tried)
        except _Transient as exc:
            raise InferenceUnavailable(f"gave up after {self._retry.attempts} tries; last error: {exc}") from None
        raise AssertionError("unreachable: the retryer re-raises the last failure")

    async def _try(
        self, method: str, path: str, json: Any, w: _Worker, tried: set[str]
    ) -> tuple[_Worker, httpx.Response]:
        """One try on worker ``w``; a transient failure marks it tried and raises ``_Transient``."""
        w.in_flight += 1
        try:
            async with self._semaphore:
                response = await w.http.request(method, path, json=json)
        except httpx.TransportError as exc:  # connection refused/reset, timeouts
            w.failures += 1
            tried.add(w.url)
            raise _Transient(f"{w.url}{path}: {type(exc).__name__}: {exc}") from exc
        finally:
            w.in_flight -= 1
        if response.status_code < 400:
            w.failures = 0
            return w, response
        detail = response.text[:500]
        if response.status_code < 500 and response.status_code != 429:
            raise InferenceRequestError(w.url, response.status_code, detail)
        w.failures += 1
        tried.add(w.url)
        raise _Transient(f"{w.url}{path}: HTTP {response.status_code}: {detail}")

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling: SamplingParams | None = None,
        *,
        return_logprob: bool = True,
        rid: str | None = None,
    ) -> Generation:
        """Generate a completion for a tokenised prompt.

        Args:
            input_ids: prompt token ids (see :meth:`apply_chat_template`).
            sampling: SGLang sampling parameters (defaults: SGLang's).
            return_logprob: ask for per-token logprobs (needed for training samples).
            rid: request id, for tracing.

        Raises:
            InferenceRequestError: the server rejected the request (bad ids, too long, ...).
            InferenceUnavailable: no worker answered within the retry budget.
        """
        sampling = sampling or SamplingParams()
        if sampling.n != 1:
            raise ValueError(f"generate() returns one sample but sampling.n is {sampling.n}; use generate_n()")
        return (await self._generate(input_ids, sampling, return_logprob, rid))[0]

    async def generate_n(
        self,
        input_ids: Sequence[int],
        sampling: SamplingParams | None = None,
        n: int = 1,
        *,
        return_logprob: bool = True,
        rid: str | None = None,
    ) -> list[Generation]:
        """``n`` samples of one prompt in one request (SGLang's parallel sampling, ``sampling_params.n``).

        The server prefills the prompt once and decodes the ``n`` continuations side by side. Every
        sample uses ``sampling`` as given, so with a ``sampling_seed`` all ``n`` are the same (as in
        SGLang); for ``n`` distinct reproducible samples use :meth:`generate_seeded`.

        Returns:
            The ``n`` generations in sample order, each with its token ids, logprobs and weight version.
        """
        params = (sampling or SamplingParams()).model_copy(update={"n": n})
        return await self._generate(input_ids, params, return_logprob, rid)

    async def generate_seeded(
        self,
        input_ids: Sequence[int],
        sampling: SamplingParams | None,
        seeds: Sequence[int],
        *,
        return_logprob: bool = True,
    ) -> list[Generation]:
        """One sample of the prompt per seed (``sampling_seed``), each reproducible on its own.

        Sent as concurrent requests: the server's prefix cache (SGLang's radix cache, the embedded
        server's too) prefills the shared prompt once for all of them.
        """
        base = sampling or SamplingParams()
        params = [base.model_copy(update={"n": 1, "sampling_seed": int(seed)}) for seed in seeds]
        results = await asyncio.gather(*(self._generate(input_ids, p, return_logprob, None) for p in params))
        return [r[0] for r in results]

    async def _generate(
        self, input_ids: Sequence[int], sampling: SamplingParams, return_logprob: bool, rid: str | None
    ) -> list[Generation]:
        if self._batch_invariant and not sampling.batch_invariant:
            sampling = sampling.with_batch_invariance()
        request = GenerateRequest(
            input_ids=[int(t) for t in input_ids],
            sampling_params=sampling,
            return_logprob=return_logprob,
            rid=rid,
        )
        body = request.model_dump(mode="json", exclude_none=True)
        worker, response = await self._request("POST", "/generate", json=body)
        try:
            payload = response.json()
            # n > 1: SGLang answers with a list of n results; n == 1: with the result itself.
            items = payload if isinstance(payload, list) else [payload]
            parsed = [GenerateResponse.model_validate(item) for item in items]
        except ValueError as exc:
            raise InferenceError(f"{worker.url}/generate returned a malformed response: {exc}") from exc
        if len(parsed) != sampling.n:
            raise InferenceError(f"{worker.url}/generate returned {len(parsed)} samples for n={sampling.n}")
        return [Generation.from_response(p, server=worker.url) for p in parsed]

    async def chat(
        self,
        messages: Sequence[Message],
        sampling: SamplingParams | None = None,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> ChatGeneration:
        """Apply the chat template, generate, and parse tool calls from the reply text."""
        # Imported here: the env library is only needed by callers that parse tool calls.
        from spade.envs.actions import parse_tool_calls

        prompt_ids = self.apply_chat_template(messages, tools)
        generation = await self.generate(prompt_ids, sampling)
        return ChatGeneration(prompt_ids, generation, parse_tool_calls(generation.text))

    async def wait_ready(self, timeout_s: float = 300.0, poll_s: float = 0.5) -> None:
        """Wait until every worker answers ``/health_generate`` with 200.

        Raises:
            InferenceUnavailable: a worker was not ready within ``timeout_s``.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s

        async def one(w: _Worker) -> None:
            last = "no answer"
            while True:
                try:
                    response = await w.http.get("/health_generate")
                    if response.status_code == 200:
                        return
                    last = f"HTTP {response.status_code}"
                except httpx.TransportError as exc:
                    last = f"{type(exc).__name__}: {exc}"
                if loop.time() >= deadline:
                    raise InferenceUnavailable(f"{w.url} not ready after {timeout_s:.0f}s ({last})")
                await asyncio.sleep(poll_s)

        await asyncio.gather(*(one(w) for w in self._workers))

    async def update_weights_from_disk(
        self, model_path: str | Path, weight_version: str, *, abort_all_requests: bool = False
    ) -> list[WeightUpdateResult]:
        """Ask every worker to load the checkpoint at ``model_path`` and report ``weight_version``.

        Workers are updated concurrently; a worker that fails (or cannot be reached) gives a result
        with ``success=False`` rather than an exception, so the caller sees every worker's outcome.
        """
        body = UpdateWeightsFromDiskRequest(
            model_path=str(model_path), weight_version=weight_version, abort_all_requests=abort_all_requests
        ).model_dump(mode="json", exclude_none=True)

        async def one(w: _Worker) -> WeightUpdateResult:
            try:
                _, response = await self._request("POST", "/update_weights_from_disk", json=body, worker=w)
                parsed = UpdateWeightsFromDiskResponse.model_validate(response.json())
            except InferenceRequestError as exc:
                try:
                    parsed = UpdateWeightsFromDiskResponse.model_validate_json(exc.detail)
                except ValueError:
                    return WeightUpdateResult(w.url, False, str(exc))
            except InferenceError as exc:
                return WeightUpdateResult(w.url, False, str(exc))
            return WeightUpdateResult(w.url, parsed.success, parsed.message, parsed.num_paused_requests)

        return list(await asyncio.gather(*(one(w) for w in self._workers)))

    async def server_info(self) -> list[ServerInfo | None]:
        """``/get_server_info`` of every worker (SGLang's server arguments), ``None`` where there is none.

        A worker that answers 404 is not an SGLang-compatible server of a version with that route;
        any other failure raises as for any request.
        """

        async def one(w: _Worker) -> ServerInfo | None:
            try:
                _, response = await self._request("GET", "/get_server_info", worker=w)
            except InferenceRequestError as exc:
                if exc.status == 404:
                    return None
                raise
            return ServerInfo.model_validate(response.json())

        return list(await asyncio.gather(*(one(w) for w in self._workers)))

    async def model_info(self) -> list[ModelInfo]:
        """``/model_info`` of every worker (model path, weight version, ...)."""

        async def one(w: _Worker) -> ModelInfo:
            _, response = await self._request("GET", "/model_info", worker=w)
            return ModelInfo.model_validate(response.json())

        return list(await asyncio.gather(*(one(w) for w in self._workers)))
