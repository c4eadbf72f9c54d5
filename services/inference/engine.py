"""The batching engine: continuous batching of generation requests on one model, on CPU.

A scheduler thread owns the model and the running batch. Each iteration it

1. applies a pending weight swap once the batch has drained (see below),
2. admits waiting requests into the running batch (up to ``max_batch_size`` rows and a prefill
   token budget), prefilling the new prompts (a long one alone, short ones several to a pass,
   :mod:`services.inference.prefill`) and merging their KV caches into the batch
   (:mod:`services.inference.kv`), and
3. decodes one token for every active sequence in a single forward pass (for a Llama-family model,
   :mod:`services.inference.llama_decode`'s lean step, the same logits without transformers'
   per-call plumbing), samples per row with the row's own parameters, and retires the rows that
   finished.

So requests join and leave a batch that keeps decoding; nobody waits for a whole batch to finish.
The asyncio side (:meth:`BatchEngine.generate_n`, :meth:`BatchEngine.stream`) only enqueues and
awaits, so the event loop stays free while torch computes in the scheduler thread.

Parallel sampling (``sampling_params.n > 1``, SGLang's ``n``): the prompt is prefilled **once** and
its KV copied into ``n`` rows that then decode independently, each with its own sampler state and
grammar matcher. Prefix reuse across requests is the radix cache's job
(:mod:`services.inference.prefix_cache`): prompts are matched against it at admission, and both the
prompt KV and, when a sequence finishes, its generated tokens' KV are added to it, so the next turn
of a conversation prefills only what is new.

Batch-invariant mode (``batch_invariant`` for every request, or ``custom_params.batch_invariant``
per request): the request's prompt is prefilled in canonical chunks with a cache of its own and each
of its sequences decodes in a forward pass of its own (a lane of one row), so its logits do not depend
on what else is in flight (:mod:`services.inference.invariance` says why that holds). Other requests
keep sharing the batched lane.

Weight updates (:meth:`BatchEngine.update_weights`): the new checkpoint is loaded from disk *while
the old weights keep serving*. Then admission stops, the requests already in the batch finish on the
old weights (or are aborted, with ``abort_all_requests``), the model is swapped and
``weight_version`` set, and admission resumes; requests that arrived meanwhile wait and run on the
new weights. Every completion is therefore produced by exactly one weight version, the one reported
in its ``meta_info.weight_version``. A failed load leaves the old weights and version in place.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicCache

from services.inference.grammar import Constraint, GrammarCompiler, GrammarError
from services.inference.invariance import CHUNK_TOKENS, canonical_prefill
from services.inference.kv import KVBatch, layer_kv
from services.inference.llama_decode import APART_MOST_ROWS, LlamaDecoder, llama_decoder
from services.inference.prefill import (
    Prompt,
    cache_of,
    defer_shared,
    group_prefills,
    prefill_together,
    use_prompt_attention,
)
from services.inference.prefix_cache import RadixPrefixCache
from services.inference.quant import decode_step, prepare_weights
from services.inference.sampling import (
    StopRule,
    finish_for_token,
    matched_stop_string,
    sample_tokens,
    trim_at_stop,
)
from services.inference.settings import WeightsMode
from spade import openmp
from spade.inference.models import load_model, load_tokenizer, resolve_model_path
from spade.inference.protocol import SamplingParams
from spade.serving.logs import get_logger

logger = get_logger(__name__)


@dataclass
class EngineWork:
    """What the scheduler thread has done since the engine started: running totals, only ever growing.

    Written by the scheduler thread alone, read at any time (``/metrics`` exports them as counters),
    so a reader diffing two readings gets the work done in between: how busy the server was (busy
    seconds per wall second) and on what.
    """

    busy_s: float = 0.0
    """Time spent in scheduler iterations that had work (weight swaps, prefills, decode steps)."""
    prefill_s: float = 0.0
    decode_s: float = 0.0
    prefills: int = 0
    """Prompts prefilled (one per request: the ``n`` samples of a request share one prefill)."""
    prefill_passes: int = 0
    """Forward passes that prefilled prompts (short prompts admitted together share one, :mod:`.prefill`)."""
    prompt_tokens: int = 0
    """Prompt tokens computed by prefills (not counting those reused from the prefix cache)."""
    cached_tokens: int = 0
    """Prompt tokens reused from the prefix cache."""
    generated_tokens: int = 0
    decode_steps: int = 0
    """Decode forward passes of one token per sequence of a lane (the batch, or one batch-invariant row)."""
    decode_rows: int = 0
    """Sequences summed over decode steps (``decode_rows / decode_steps``: the mean batch size)."""
    invariant_prefills: int = 0
    """Prompts prefilled in the batch-invariant mode (also counted in ``prefills``)."""
    invariant_steps: int = 0
    """Decode passes of batch-invariant rows (also counted in ``decode_steps``): each row alone, or
    several in one pass where the products are row-invariant (:meth:`LlamaDecoder.apart`)."""
    invariant_rows: int = 0
    """Batch-invariant sequences summed over those passes."""


class EngineError(RuntimeError):
    """Base class of the engine's errors."""


class InvalidRequest(EngineError, ValueError):
    """The request cannot be served as given (maps to HTTP 400)."""


class Overloaded(EngineError):
    """The waiting queue is full (maps to HTTP 503; clients retry with backoff)."""


class EngineClosed(EngineError):
    """The engine is shutting down (maps to HTTP 503)."""


class EngineFault(EngineError):
    """An internal failure while computing (maps to HTTP 500)."""


@dataclass(frozen=True)
class GenerationJob:
    """One request, as the engine sees it (``params.n`` sequences sampled from one prompt).

    ``grammar`` is the compiled ``regex``/``ebnf``/``json_schema`` constraint; the engine compiles it
    from ``params`` when it is not given.
    """

    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool = True
    logprob_start_len: int = -1
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    grammar: Any = None

    @property
    def n(self) -> int:
        """How many sequences this job samples."""
        return self.params.n


@dataclass(frozen=True)
class GenerationOutcome:
    """The result of one job, in SGLang's terms."""

    rid: str
    output_ids: list[int]
    output_logprobs: list[float]
    input_logprobs: list[tuple[float | None, int]]
    finish_reason: dict[str, Any]
    weight_version: str
    prompt_tokens: int
    text: str
    latency_s: float
    cached_tokens: int = 0
    index: int = 0


@dataclass(frozen=True)
class WeightUpdateOutcome:
    """The result of a weight update."""

    success: bool
    message: str
    num_paused_requests: int = 0


@dataclass(frozen=True)
class TokenEvent:
    """A streamed token of sample ``index`` (sent from the scheduler as it is sampled)."""

    index: int
    token_id: int
    logprob: float


@dataclass(frozen=True)
class FinishEvent:
    """Sample ``index`` is complete; ``outcome`` is what a non-streamed request would return."""

    index: int
    outcome: GenerationOutcome


StreamEvent = TokenEvent | FinishEvent


@dataclass
class _Pending:
    job: GenerationJob
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[list[GenerationOutcome]]
    arrived: float
    cancelled: bool = False
    events: asyncio.Queue[StreamEvent | BaseException] | None = None
    results: list[GenerationOutcome | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.results = [None] * self.job.n

    def emit(self, event: StreamEvent | BaseException) -> None:
        """Send a stream event to the waiting coroutine (scheduler thread)."""
        if self.events is not None:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)


@dataclass
class _Row:
    pending: _Pending
    index: int
    rule: StopRule
    generator: torch.Generator | None
    version: str
    constraint: Constraint | None = None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    input_logprobs: list[tuple[float | None, int]] = field(default_factory=list)
    finish: dict[str, Any] | None = None
    stop_string: str | None = None
    cached_tokens: int = 0


@dataclass
class _Lane:
    """Sequences decoded together, one forward pass per step, with their KV batch.

    The engine has one shared lane (continuous batching) and one lane per sequence of a
    batch-invariant request, with a KV of its own: such rows share a pass only where no row's
    numbers depend on it (:meth:`BatchEngine._decode_apart`), each still attending to its own KV.
    """

    kv: KVBatch = field(default_factory=KVBatch)
    rows: list[_Row] = field(default_factory=list)
    next_tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)

    def add(self, row: _Row, next_token: int, position: int) -> None:
        self.rows.append(row)
        self.next_tokens.append(next_token)
        self.positions.append(position)

    def keep(self, keep: list[int]) -> None:
        """Keep only the rows at ``keep`` (in that order)."""
        self.rows = [self.rows[i] for i in keep]
        self.next_tokens = [self.next_tokens[i] for i in keep]
        self.positions = [self.positions[i] for i in keep]
        self.kv.keep_rows(keep)


@dataclass
class _Swap:
    model: Any
    decoder: LlamaDecoder | None
    path: Path
    version: str
    abort_all: bool
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[WeightUpdateOutcome]
    paused: int | None = None  # requests in flight when the scheduler first saw the swap


def _resolve(loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any], value: Any) -> None:
    """Complete ``future`` from the scheduler thread (ignored if the waiter has gone)."""

    def apply() -> None:
        if future.done():
            return
        if isinstance(value, BaseException):
            future.set_exception(value)
        else:
            future.set_result(value)

    loop.call_soon_threadsafe(apply)


def _next_version(current: str) -> str:
    return str(int(current) + 1) if current.isdigit() else current


class BatchEngine:
    """Serve generation requests from one model with continuous batching.

    Args:
        model_path: checkpoint directory (``None``: the default SmolLM2 model).
        weight_version: the version reported before any update.
        max_batch_size: most sequences decoded together.
        max_waiting: most requests queued for admission; more are refused with :class:`Overloaded`.
        max_prefill_tokens: prompt tokens admitted per scheduler iteration (at least one request).
        prefill_batch_tokens: most tokens one pass computes when it prefills several short prompts
            together (:mod:`.prefill`); 0: every prompt is prefilled alone.
        context_length: longest prompt + completion; ``None``: the model's ``max_position_embeddings``.
        dtype: weights' dtype (float32 keeps logprobs within 1e-4 of a float32 learner).
        weights: ``float32`` serves the checkpoint's weights (prepacked for oneDNN too:
            :class:`.quant.Fp32Linear`); ``bf16`` decodes (and, where the CPU has native bf16, prefills) with bf16
            weights; ``int8`` decodes from int8 weights
            (:mod:`.quant`: about 1.5× the single-stream tokens/s, logprobs no longer within 1e-4 of
            the learner's, which corrects them by truncated importance sampling); ``int4`` from 4-bit
            layers with an int8 LM head. Applied again to every weight update.
        torch_threads: intra-op threads of the scheduler thread (which does all model compute);
            ``None``: torch's default. Set only for that thread, so the rest of the process keeps its own.
        prefix_cache_tokens: tokens whose KV the radix cache keeps for reuse (:mod:`.prefix_cache`); 0: off.
            The batch-invariant mode's cache of canonical chunks has a budget of its own of the same size.
        batch_invariant: compute every request batch-invariantly (SGLang's
            ``--enable-deterministic-inference``); otherwise only requests that ask for it.
        invariant_chunk_tokens: prefill chunk of the batch-invariant mode (:mod:`.invariance`).
        lean_decode: decode a Llama-family model's steps without transformers' per-call plumbing
            (:mod:`.llama_decode`; the same logits up to fp32 rounding); ``False``: transformers' forward
            decodes, as it prefills (for comparison: ``bench/inference_bench.py --hf-decode``).
        invariant_rows_together: decode the batch-invariant rows together, each attending to its own KV,
            where the lean step's products are row-invariant on this CPU (:meth:`.LlamaDecoder.apart`);
            ``False``: each row in a pass of its own (for comparison: ``bench/invariant_bench.py``).
    """

    def __init__(
        self,
        model_path: Path | None = None,
        *,
        weight_version: str = "0",
        max_batch_size: int = 32,
        max_waiting: int = 1024,
        max_prefill_tokens: int = 8192,
        prefill_batch_tokens: int = 1024,
        context_length: int | None = None,
        dtype: torch.dtype = torch.float32,
        torch_threads: int | None = None,
        prefix_cache_tokens: int = 8192,
        batch_invariant: bool = False,
        invariant_chunk_tokens: int = CHUNK_TOKENS,
        weights: WeightsMode = "float32",
        lean_decode: bool = True,
        invariant_rows_together: bool = True,
    ) -> None:
        if weights != "float32" and dtype != torch.float32:
            raise ValueError(f"{weights} weights are quantized from float32 weights, not {dtype}")
        self.model_path = resolve_model_path(model_path)
        self.tokenizer_path = self.model_path
        self.weight_version = weight_version
        self.max_batch_size = max_batch_size
        self.max_waiting = max_waiting
        self.max_prefill_tokens = max_prefill_tokens
        self.prefill_batch_tokens = prefill_batch_tokens
        self.dtype = dtype
        self.torch_threads = torch_threads
        self.prefix_cache = RadixPrefixCache(prefix_cache_tokens, dtype=dtype)
        self.batch_invariant = batch_invariant
        self.invariant_chunk_tokens = invariant_chunk_tokens
        #: Only KV of whole canonical chunks (:mod:`.invariance`), so reuse equals recomputing.
        self.invariant_cache = RadixPrefixCache(prefix_cache_tokens, min_match=invariant_chunk_tokens)
        self.tokenizer = load_tokenizer(self.model_path)
        self.weights: WeightsMode = weights
        self.lean_decode = lean_decode
        self.invariant_rows_together = invariant_rows_together
        #: The served model, and its decode step without transformers' plumbing where it has one
        #: (:mod:`.llama_decode`; ``None``: transformers' forward decodes too).
        self.model, self.decoder = self._serve(load_model(self.model_path, dtype))
        self.config = self.model.config
        self.context_length = context_length or int(getattr(self.config, "max_position_embeddings", 4096))
        self.vocab_size = int(self.config.vocab_size)
        eos = self.model.generation_config.eos_token_id if self.model.generation_config else None
        eos = eos if eos is not None else self.tokenizer.eos_token_id
        self.eos_ids: list[int] = [int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None]
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_ids)
        openmp.release_threads()  # loading ran parallel regions on this thread; the scheduler's must spin

        self._cond = threading.Condition()
        self._waiting: collections.deque[_Pending] = collections.deque()
        self._swap: _Swap | None = None
        self._stopping = False
        self._shared = self._shared_lane()
        self._solo: list[_Lane] = []  # one lane per sequence of a batch-invariant request
        self._update_locks: dict[asyncio.AbstractEventLoop, asyncio.Lock] = {}
        self._thread: threading.Thread | None = None
        self._dropped = False  # the weights, once closed (:meth:`close`)
        self.last_progress = time.monotonic()
        #: Most sequences ever decoded in one forward pass (observability; proves batching happens).
        self.peak_batch_rows = 0
        #: Running totals of the scheduler's work (``/metrics``).
        self.work = EngineWork()

    # -- lifecycle -----------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the scheduler thread (idempotent; a closed engine stays closed)."""
        if self._thread is not None or self._stopping:
            return
        self._thread = threading.Thread(target=self._run, name="inference-scheduler", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the scheduler; waiting and running requests fail with :class:`EngineClosed`.

        A closed engine never serves again (its scheduler does not restart), so once the scheduler has
        ended the engine drops its weights and cached KV: the engine object itself may outlive its use by
        far. FastAPI keeps the endpoints it has seen, up to 4,096, for the life of the process, and the
        app's endpoints close over the engine; so every embedded run a process made kept its model (and a CI
        worker that had run several held 14 GB).
        """
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            thread = self._thread
        if thread is None:
            self._drop_weights()  # never started: nothing else will
            return
        thread.join(timeout=60)  # the scheduler drops the weights as it ends (:meth:`_run`)
        if not thread.is_alive():
            self._thread = None

    def _drop_weights(self) -> None:
        """Called once the scheduler has ended (on its own thread) or where it never started: the lanes are empty
        then (the scheduler's :meth:`_shutdown` emptied them), so what is left is the caches and the model."""
        with self._cond:
            if self._dropped:
                return
            self._dropped = True
        self.prefix_cache.clear()
        self.invariant_cache.clear()
        del self.model, self.decoder

    @property
    def running(self) -> bool:
        """Whether the scheduler thread is serving."""
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def _lanes(self) -> list[_Lane]:
        return [self._shared, *self._solo]

    def _all_rows(self) -> list[_Row]:
        return [row for lane in self._lanes() for row in lane.rows]

    @property
    def num_running(self) -> int:
        return sum(len(lane.rows) for lane in self._lanes())

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def swap_pending(self) -> bool:
        """Whether a weight swap is waiting for the batch to drain (admission has stopped meanwhile)."""
        return self._swap is not None

    # -- asyncio API ---------------------------------------------------------------------------------

    def validate(self, job: GenerationJob) -> None:
        """Raise :class:`InvalidRequest` when ``job`` cannot be served."""
        n = len(job.input_ids)
        if n >= self.context_length:
            raise InvalidRequest(
                f"the input ({n} tokens) is longer than the model's context length "
                f"({self.context_length} tokens); shorten the prompt"
            )
        bad = next((t for t in job.input_ids if t >= self.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"input_ids holds token id {bad}, outside the vocabulary (size {self.vocab_size})")
        if job.logprob_start_len >= n:
            raise InvalidRequest(f"logprob_start_len ({job.logprob_start_len}) must be < the input length ({n})")
        if job.n > self.max_batch_size:
            raise InvalidRequest(
                f"sampling_params.n ({job.n}) is more than this server decodes at once "
                f"(max_batch_size={self.max_batch_size}); ask for at most {self.max_batch_size} samples"
            )

    async def prepare(self, job: GenerationJob) -> GenerationJob:
        """Validate ``job`` and compile its constraint (off the scheduler thread)."""
        self.validate(job)
        constraint = job.params.constraint()
        if constraint is None or job.grammar is not None:
            return job
        try:
            compiled = await asyncio.to_thread(self.grammars.compile, *constraint)
        except GrammarError as exc:
            raise InvalidRequest(str(exc)) from exc
        return replace(job, grammar=compiled)

    def _enqueue(self, job: GenerationJob, *, stream: bool) -> _Pending:
        loop = asyncio.get_running_loop()
        pending = _Pending(job, loop, loop.create_future(), time.monotonic())
        if stream:
            pending.events = asyncio.Queue()
        with self._cond:
            if self._stopping or self._thread is None:
                raise EngineClosed("the inference engine is not running")
            if len(self._waiting) >= self.max_waiting:
                raise Overloaded(f"{len(self._waiting)} requests already waiting (max_waiting={self.max_waiting})")
            self._waiting.append(pending)
            self._cond.notify_all()
        return pending

    async def generate_n(self, job: GenerationJob) -> list[GenerationOutcome]:
        """Queue ``job`` and wait for all ``job.n`` of its samples (in sample order).

        Raises:
            InvalidRequest, Overloaded, EngineClosed, EngineFault: see the classes.
        """
        pending = self._enqueue(await self.prepare(job), stream=False)
        try:
            return await pending.future
        except asyncio.CancelledError:
            pending.cancelled = True  # the scheduler drops its rows at its next step
            raise

    async def generate(self, job: GenerationJob) -> GenerationOutcome:
        """Queue a one-sample ``job`` (``params.n == 1``) and wait for its completion."""
        if job.n != 1:
            raise InvalidRequest(f"generate() returns one sample but sampling_params.n is {job.n}; use generate_n()")
        return (await self.generate_n(job))[0]

    async def stream(self, job: GenerationJob) -> AsyncGenerator[StreamEvent, None]:
        """Queue ``job`` and yield each token as it is sampled, then one :class:`FinishEvent` per sample.

        Closing the iterator early cancels the request.
        """
        pending = self._enqueue(await self.prepare(job), stream=True)
        assert pending.events is not None
        finished = 0
        try:
            while finished < job.n:
                event = await pending.events.get()
                if isinstance(event, BaseException):
                    raise event
                if isinstance(event, FinishEvent):
                    finished += 1
                yield event
        finally:
            if finished < job.n:
                pending.cancelled = True

    async def update_weights(
        self, model_path: str | Path, weight_version: str | None = None, *, abort_all_requests: bool = False
    ) -> WeightUpdateOutcome:
        """Load a checkpoint and swap it in (see the module docstring for in-flight requests).

        ``weight_version`` ``None`` increments a numeric version (and keeps any other unchanged).
        Failures (missing path, incompatible vocabulary) return ``success=False`` and keep the
        current weights.
        """
        async with self._update_lock():
            if self._stopping:  # closed, before or while this update waited for the one before it
                return WeightUpdateOutcome(False, "the inference engine is not running")
            try:
                path = resolve_model_path(Path(model_path))
                model, decoder = await asyncio.to_thread(openmp.then_release, self._load, path)
            except Exception as exc:
                return WeightUpdateOutcome(False, f"failed to load weights from {model_path}: {exc}")
            if int(model.config.vocab_size) != self.vocab_size:
                return WeightUpdateOutcome(
                    False,
                    f"{model_path} has vocabulary size {model.config.vocab_size}, the served model "
                    f"{self.vocab_size}; a weight update must keep the tokenizer",
                )
            version = weight_version if weight_version is not None else _next_version(self.weight_version)
            return await self._swap_in(model, decoder, path, version, abort_all_requests)

    def _load(self, path: Path) -> tuple[PreTrainedModel, LlamaDecoder | None]:
        """A checkpoint's weights as this engine serves them (:meth:`_serve`)."""
        return self._serve(load_model(path, self.dtype, like=self.model))

    def _serve(self, model: PreTrainedModel) -> tuple[PreTrainedModel, LlamaDecoder | None]:
        """``model`` as this engine serves it (its linear layers packed or quantized, in place) and its
        lean decode step, if it has one."""
        model = prepare_weights(model, self.weights).eval()
        if self.weights != "float32":  # fp32 prefills keep SDPA: they give transformers' logits bit for bit
            use_prompt_attention(model)
        return model, (llama_decoder(model) if self.lean_decode else None)

    def _update_lock(self) -> asyncio.Lock:
        """Serialises weight updates (one asyncio lock per event loop that calls us)."""
        loop = asyncio.get_running_loop()
        lock = self._update_locks.get(loop)
        if lock is None:
            self._update_locks = {lp: lk for lp, lk in self._update_locks.items() if not lp.is_closed()}
            lock = self._update_locks[loop] = asyncio.Lock()
        return lock

    async def swap_weights(
        self, model: Any, model_path: Path, weight_version: str, *, abort_all_requests: bool = False
    ) -> WeightUpdateOutcome:
        """Swap in an already loaded model (same semantics as :meth:`update_weights`, minus the load).

        The engine takes ``model`` over: in a quantized mode its linear layers are replaced in place.
        """
        if int(model.config.vocab_size) != self.vocab_size:
            return WeightUpdateOutcome(False, f"vocabulary size {model.config.vocab_size} != {self.vocab_size}")
        model, decoder = await asyncio.to_thread(openmp.then_release, self._serve, model)
        async with self._update_lock():
            return await self._swap_in(model, decoder, model_path, weight_version, abort_all_requests)

    async def _swap_in(
        self, model: Any, decoder: LlamaDecoder | None, path: Path, version: str, abort_all: bool
    ) -> WeightUpdateOutcome:
        loop = asyncio.get_running_loop()
        swap = _Swap(model, decoder, path, version, abort_all, loop, loop.create_future())
        with self._cond:
            if self._stopping or self._thread is None:
                return WeightUpdateOutcome(False, "the inference engine is not running")
            self._swap = swap
            self._cond.notify_all()
        return await swap.future

    @property
    def kv_dtype(self) -> torch.dtype:
        """What the shared batch keeps its keys and values in: bf16 where its steps attend to bf16 KV
        (:attr:`.LlamaDecoder.kv_dtype`), else the model's dtype. The prefix cache keeps the model's dtype."""
        return self._shared.kv.dtype or self.dtype

    def flush_cache(self) -> bool:
        """Drop the prefix cache if the server is idle (SGLang refuses while requests run)."""
        if self.num_running or self._waiting:
            return False
        self.prefix_cache.clear()
        self.invariant_cache.clear()
        return True

    # -- scheduler thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        if self.torch_threads is not None:
            torch.set_num_threads(self.torch_threads)  # OpenMP: this thread only
        while True:
            with self._cond:
                if not (self._stopping or self._waiting or self.num_running or self._swap):
                    openmp.release_threads()  # idle: another thread's workers may spin meanwhile (spade.openmp)
                while not (self._stopping or self._waiting or self.num_running or self._swap):
                    self._cond.wait()
                if self._stopping:
                    break
                admitted = self._take_admissions()
            start = time.perf_counter()
            try:
                with torch.inference_mode():
                    self._apply_swap_if_drained()
                    self._admit(admitted)
                    prefilled = time.perf_counter()
                    self._decode_step()
                    self._retire()
                self.work.prefill_s += prefilled - start
                self.work.decode_s += time.perf_counter() - prefilled
            except Exception as exc:
                logger.exception("inference scheduler step failed; failing the affected requests")
                self._fail_all(admitted, EngineFault(f"generation failed: {type(exc).__name__}: {exc}"))
            self.work.busy_s += time.perf_counter() - start
        self._shutdown()
        self._drop_weights()

    def _take_admissions(self) -> list[_Pending]:
        """Pop the requests to admit now (none while a weight swap is waiting to drain)."""
        if self._swap is not None:
            return []
        taken: list[_Pending] = []
        budget = self.max_prefill_tokens
        rows = self.num_running
        while self._waiting:
            head = self._waiting[0]
            if head.cancelled:
                self._waiting.popleft()
                continue
            if rows + head.job.n > self.max_batch_size or (taken and len(head.job.input_ids) > budget):
                break
            self._waiting.popleft()
            budget -= len(head.job.input_ids)
            rows += head.job.n
            taken.append(head)
        return taken

    def _apply_swap_if_drained(self) -> None:
        swap = self._swap
        if swap is None:
            return
        rows = self._all_rows()
        if swap.paused is None:
            swap.paused = len(rows)
        if swap.abort_all and rows:
            for row in rows:
                row.finish = {"type": "abort", "message": "aborted by a weight update", "status_code": 503}
            self._retire()
        if self.num_running:
            return  # drain: in-flight requests finish on the old weights
        old = self.model
        self.model, self.model_path, self.weight_version = swap.model, swap.path, swap.version
        self.config = swap.model.config
        self.decoder = swap.decoder
        self._shared = self._shared_lane()  # empty (drained); the new model's step may keep its KV otherwise
        self.prefix_cache.clear()  # the cached KV was computed by the old weights
        self.invariant_cache.clear()
        del old
        with self._cond:
            self._swap = None
        message = f"Succeeded to update model weights from {swap.path}; weight_version={swap.version}"
        logger.info(message)
        _resolve(swap.loop, swap.future, WeightUpdateOutcome(True, message, swap.paused))

    def _forward(self, **kwargs: Any) -> torch.Tensor:
        out = self.model(use_cache=True, return_dict=True, **kwargs)
        return out.logits

    def _prefill_forward(self, **kwargs: Any) -> torch.Tensor:
        self.work.prefill_passes += 1
        return self._forward(**kwargs)

    def _admit(self, admitted: list[_Pending]) -> None:
        live = [pending for pending in admitted if not pending.cancelled]
        prefilled = self._prefill_admitted([pending.job for pending in live])
        shared: list[DynamicCache] = []
        for pending, (reused, cache, logits) in zip(live, prefilled, strict=True):
            job = pending.job
            invariant = self.batch_invariant or job.params.batch_invariant
            want_inputs = job.return_logprob and job.logprob_start_len >= 0
            self.work.prefills += 1
            self.work.prompt_tokens += len(job.input_ids) - reused
            self.work.cached_tokens += reused
            budget = min(job.params.max_new_tokens, self.context_length - len(job.input_ids))
            rule = StopRule.build(job.params, self.eos_ids, budget)
            input_logprobs = self._input_logprobs(logits, job.input_ids, job.logprob_start_len) if want_inputs else []
            # One prefill, n rows: every sample starts from the same prompt KV and the same logits.
            for index in range(job.n):
                generator = None
                if job.params.sampling_seed is not None:
                    generator = torch.Generator().manual_seed(job.params.sampling_seed % 2**63)
                constraint = Constraint(job.grammar, self.vocab_size) if job.grammar is not None else None
                row = _Row(pending, index, rule, generator, self.weight_version, constraint)
                row.cached_tokens = reused
                row.input_logprobs = input_logprobs
                lane = _Lane() if invariant else self._shared
                if budget <= 0:
                    row.finish = {"type": "length", "length": 0}
                    lane.add(row, -1, -1)  # retired at once
                else:
                    self._append_tokens([row], logits[-1:])
                    lane.add(row, row.output_ids[-1], len(job.input_ids))
                if invariant:
                    lane.kv.add_rows([cache])
                    self._solo.append(lane)
                else:
                    shared.append(cache)
        self._shared.kv.add_rows(shared)

    def _prefill_admitted(self, jobs: list[GenerationJob]) -> list[tuple[int, DynamicCache, torch.Tensor]]:
        """Prefill the prompts of ``jobs``: ``(tokens reused, KV cache, logits)`` for each, in order.

        Batch-invariant requests prefill in canonical chunks, requests for prompt logprobs alone with
        every position's logits; the rest share the prefix cache and are prefilled in rounds: each
        round matches them against the cache, defers those that wait for an earlier one's KV
        (:func:`~services.inference.prefill.defer_shared`) and prefills the others, the short ones
        several to a pass (:func:`~services.inference.prefill.group_prefills`).
        """
        done: dict[int, tuple[int, DynamicCache, torch.Tensor]] = {}
        waiting: list[int] = []
        for i, job in enumerate(jobs):
            if self.batch_invariant or job.params.batch_invariant:
                done[i] = canonical_prefill(
                    self._prefill_forward,
                    self.config,
                    job.input_ids,
                    self.invariant_cache,
                    chunk=self.invariant_chunk_tokens,
                    all_logits=job.return_logprob and job.logprob_start_len >= 0,
                )
                self.work.invariant_prefills += 1
            elif job.return_logprob and job.logprob_start_len >= 0:
                done[i] = self._prefill(Prompt(job.input_ids, 0, None), all_logits=True)
            else:
                waiting.append(i)
        while waiting:
            prompts = [Prompt(jobs[i].input_ids, *self.prefix_cache.match(jobs[i].input_ids)) for i in waiting]
            now, later = defer_shared(prompts)
            for group in group_prefills([prompts[k] for k in now], self.prefill_batch_tokens):
                members = [now[g] for g in group]
                if len(members) == 1:
                    done[waiting[members[0]]] = self._prefill(prompts[members[0]], all_logits=False)
                    continue
                together = prefill_together(self._prefill_forward, self.config, [prompts[k] for k in members])
                for k, (kv, logits) in zip(members, together, strict=True):
                    self.prefix_cache.insert(prompts[k].ids, kv)
                    done[waiting[k]] = (prompts[k].reused, cache_of(kv, self.config), logits)
            waiting = [waiting[k] for k in later]
        return [done[i] for i in range(len(jobs))]

    def _prefill(self, prompt: Prompt, *, all_logits: bool) -> tuple[int, DynamicCache, torch.Tensor]:
        """Prefill ``prompt`` alone in one pass after its cached prefix; the prompt's KV goes to the cache.

        Returns ``(tokens reused, KV cache, logits)`` (every position's with ``all_logits``, which
        needs a prompt without a cached prefix: cached positions have no logits).
        """
        ids, reused = prompt.ids, prompt.reused
        cache = DynamicCache(config=self.config)
        for layer_index, (keys, values) in enumerate(prompt.prefix or []):
            cache.update(keys, values, layer_index)
        logits = self._prefill_forward(
            input_ids=torch.tensor([list(ids[reused:])], dtype=torch.long),
            cache=cache,
            position_ids=torch.arange(reused, len(ids)).unsqueeze(0),
            logits_to_keep=0 if all_logits else 1,
        )[0]
        self.prefix_cache.insert(ids, [layer_kv(layer) for layer in cache.layers])
        return reused, cache, logits

    @staticmethod
    def _input_logprobs(logits: torch.Tensor, ids: list[int], start: int) -> list[tuple[float | None, int]]:
        out: list[tuple[float | None, int]] = []
        for i in range(start, len(ids)):
            if i == 0:
                out.append((None, ids[0]))
            else:
                out.append((float(torch.log_softmax(logits[i - 1].float(), dim=-1)[ids[i]].item()), ids[i]))
        return out

    def _append_tokens(self, rows: Sequence[_Row], logits: torch.Tensor) -> None:
        """Sample the next token of every row of ``rows`` from its row of ``logits`` (``[rows, vocab]``) in
        one batched draw (``sample_tokens``), and record each."""
        constrained = [i for i, row in enumerate(rows) if row.constraint is not None]
        if constrained:
            # SGLang applies the grammar mask before the sampler: logprobs are the constrained ones.
            logits = logits.float().clone()
            for i in constrained:
                constraint = rows[i].constraint
                assert constraint is not None
                logits[i] = constraint.mask(logits[i])
        drawn = sample_tokens(logits, [row.pending.job.params for row in rows], [row.generator for row in rows])
        for row, (token, logprob) in zip(rows, drawn, strict=True):
            self._record_token(row, token, logprob)

    def _record_token(self, row: _Row, token: int, logprob: float) -> None:
        self.work.generated_tokens += 1
        row.output_ids.append(token)
        row.logprobs.append(logprob)
        row.pending.emit(TokenEvent(row.index, token, logprob))
        row.finish = finish_for_token(row.rule, token, len(row.output_ids))
        if row.constraint is not None:
            if not row.constraint.accept(token):
                raise EngineFault(f"the grammar rejected token {token} that its own mask allowed")
            if row.finish is None and row.constraint.terminated:
                row.finish = {"type": "stop", "matched": token}
        if row.rule.stop_strings and (row.finish is None or row.finish["type"] == "length"):
            tail = str(self.tokenizer.decode(row.output_ids[-row.rule.tail_tokens :], skip_special_tokens=True))
            matched = matched_stop_string(row.rule, tail)
            if matched is not None:
                row.stop_string = matched
                row.finish = {"type": "stop", "matched": matched}

    def _decode_step(self) -> None:
        """One token for every running sequence: one pass for the shared lane, and the batch-invariant
        rows together in passes of their own where the products are row-invariant (else one each)."""
        self._decode_lane(self._shared)
        if not self._solo:
            return
        if not self.invariant_rows_together or self.decoder is None or self.decoder.rows_apart is None:
            for lane in list(self._solo):
                self._decode_lane(lane)
            return
        if any(row.finish is not None or row.pending.cancelled for lane in self._solo for row in lane.rows):
            self._retire()
        for start in range(0, len(self._solo), APART_MOST_ROWS):
            self._decode_apart(self._solo[start : start + APART_MOST_ROWS])

    def _decode_apart(self, lanes: list[_Lane]) -> None:
        """One token for each batch-invariant lane's row (one row a lane) in one pass, each row's
        attention on its own KV (:meth:`LlamaDecoder.apart`): a row's numbers are those of any such pass."""
        assert self.decoder is not None and all(len(lane.rows) == 1 for lane in lanes)
        input_ids = torch.tensor([lane.next_tokens for lane in lanes], dtype=torch.long)
        position_ids = torch.tensor([lane.positions for lane in lanes], dtype=torch.long)
        caches = [lane.kv.cache for lane in lanes]
        with decode_step():
            logits = self.decoder.apart(input_ids, position_ids, caches)  # type: ignore[arg-type]
        self._count_pass(len(lanes), invariant=True)
        for i, lane in enumerate(lanes):
            self._append_tokens(lane.rows, logits[i : i + 1])
            lane.next_tokens[0] = lane.rows[0].output_ids[-1]
            lane.positions[0] += 1
        self.last_progress = time.monotonic()

    def _count_pass(self, rows: int, *, invariant: bool) -> None:
        self.peak_batch_rows = max(self.peak_batch_rows, rows)
        self.work.decode_steps += 1
        self.work.decode_rows += rows
        if invariant:
            self.work.invariant_steps += 1
            self.work.invariant_rows += rows

    def _decode_lane(self, lane: _Lane) -> None:
        live = [i for i, row in enumerate(lane.rows) if row.finish is None and not row.pending.cancelled]
        if not live:
            return
        if len(live) != len(lane.rows):
            self._retire()
        mask = lane.kv.step_mask()
        input_ids = torch.tensor(lane.next_tokens, dtype=torch.long).unsqueeze(1)
        position_ids = torch.tensor(lane.positions, dtype=torch.long).unsqueeze(1)
        assert lane.kv.cache is not None
        with decode_step():
            if self.decoder is not None:
                logits = self.decoder(input_ids, position_ids, mask, lane.kv.cache)
            else:
                logits = self._forward(
                    input_ids=input_ids, position_ids=position_ids, attention_mask=mask, cache=lane.kv.cache
                )[:, -1, :]
        self._count_pass(len(lane.rows), invariant=lane is not self._shared)
        self._append_tokens(lane.rows, logits)
        for i, row in enumerate(lane.rows):
            lane.next_tokens[i] = row.output_ids[-1]
            lane.positions[i] += 1
        self.last_progress = time.monotonic()

    def _retire(self) -> None:
        """Deliver finished and drop cancelled rows of every lane; compact the lanes."""
        done = self._retire_lane(self._shared, cache_outputs=True)
        for lane in self._solo:
            # A batch-invariant sequence's decode KV is not canonical (see .invariance): not cached.
            done += self._retire_lane(lane, cache_outputs=False)
        self._solo = [lane for lane in self._solo if lane.rows]
        for row in done:
            self._deliver(row)

    def _retire_lane(self, lane: _Lane, *, cache_outputs: bool) -> list[_Row]:
        """Drop the lane's finished and cancelled rows; returns the finished ones, to deliver."""
        keep: list[int] = []
        done: list[_Row] = []
        for i, row in enumerate(lane.rows):
            if row.pending.cancelled:
                continue
            if row.finish is None:
                keep.append(i)
                continue
            done.append(row)
            if cache_outputs and row.output_ids:
                # Keep the finished sequence's KV (prompt + all but the last token, which was sampled
                # but never fed back) so a next turn that resends this conversation reuses it.
                ids = row.pending.job.input_ids + row.output_ids[:-1]
                self.prefix_cache.insert(ids, lane.kv.row_kv(i))
        if len(keep) != len(lane.rows):
            # Compact before delivering, so a caller that sees its answer never sees its row running.
            lane.keep(keep)
        return done

    def _deliver(self, row: _Row) -> None:
        job, finish = row.pending.job, row.finish or {"type": "abort", "message": "unfinished"}
        text = str(self.tokenizer.decode(row.output_ids, skip_special_tokens=job.params.skip_special_tokens))
        if row.stop_string is not None and not job.params.no_stop_trim:
            text = trim_at_stop(text, row.stop_string)
        outcome = GenerationOutcome(
            rid=job.rid if job.n == 1 else f"{job.rid}-{row.index}",
            output_ids=list(row.output_ids),
            output_logprobs=list(row.logprobs),
            input_logprobs=list(row.input_logprobs),
            finish_reason=finish,
            weight_version=row.version,
            prompt_tokens=len(job.input_ids),
            text=text,
            latency_s=time.monotonic() - row.pending.arrived,
            cached_tokens=row.cached_tokens,
            index=row.index,
        )
        pending = row.pending
        pending.results[row.index] = outcome
        pending.emit(FinishEvent(row.index, outcome))
        if all(r is not None for r in pending.results):
            _resolve(pending.loop, pending.future, list(pending.results))

    def _fail_all(self, admitted: list[_Pending], error: Exception) -> None:
        for pending in {id(p): p for p in [*admitted, *(row.pending for row in self._all_rows())]}.values():
            _resolve(pending.loop, pending.future, error)
            pending.emit(error)
        self._shared, self._solo = self._shared_lane(), []

    def _shared_lane(self) -> _Lane:
        """An empty shared lane, its KV in bf16 where the served model's steps attend to bf16 KV
        (:attr:`.LlamaDecoder.kv_dtype`), else in the model's dtype (transformers' forward decodes it). The
        batch-invariant lanes keep the model's dtype: their rows' numbers must be those of any other such pass."""
        return _Lane(KVBatch(self.decoder.kv_dtype if self.decoder is not None else self.dtype))

    def _shutdown(self) -> None:
        error = EngineClosed("the inference engine shut down")
        with self._cond:
            waiting, self._waiting = list(self._waiting), collections.deque()
            swap, self._swap = self._swap, None
        self._fail_all(waiting, error)
        if swap is not None:
            _resolve(swap.loop, swap.future, WeightUpdateOutcome(False, str(error)))


EngineFactory = Callable[[], BatchEngine]
