"""Batch-invariant prefill: a prompt's KV and logits that do not depend on what else is in flight.

Why the numbers move otherwise. A float32 forward pass is exact only up to rounding, and the
rounding depends on the shapes the kernels see: a decode step of 4 rows runs other GEMM and
attention blockings than a step of 1 row, a left-padded row attends over more (masked) columns, and
a prompt whose first 256 tokens come from the prefix cache computes the rest as a 264-row pass
where a fresh prompt runs one 520-row pass (measured with SmolLM2: logits differ by up to 3e-5).
Those differences flip a sampled token now and then, and then the whole reply differs. So the same
seeded request gives a reply that depends on the concurrency and on what the cache happened to hold.

The batch-invariant mode (the engine's ``batch_invariant``, per request or for the whole server)
removes both dependencies by computing every request the same way, whatever else runs:

- **Decode apart**: each of the request's sequences attends to a KV of its own (no other rows, no
  padding), so its attention's shapes depend only on its own length. Its matrix products share a
  pass with the other batch-invariant rows only where this CPU's kernels give a row the same bits
  whatever rows are beside it (probed: :meth:`.llama_decode.LlamaDecoder.apart`); otherwise, and
  without the lean decode step, each sequence decodes in a forward pass of its own.
- **Canonical chunked prefill** (this module): the prompt is computed in chunks of
  ``chunk`` tokens at fixed positions ``[0, c), [c, 2c), ...``, each chunk attending to the KV of
  the chunks before it. Chunk ``i`` of two prompts that share their first ``(i + 1) * c`` tokens is
  then the same computation on the same inputs (same shapes, same KV before it), so its KV is
  bitwise the same; by induction over the chunks, so are all later chunks and the last logits.
- **A cache of whole chunks**: only the KV of whole chunks computed this way is kept (in a radix
  cache of its own, :mod:`services.inference.prefix_cache`), and a match is cut down to whole
  chunks. Reusing a cached chunk is therefore exactly computing it again, so the cache can stay on:
  a later turn of a conversation still skips every whole chunk of the history it resends.

What this rests on: the CPU kernels are deterministic for a given shape and thread count (true of
MKL/oneDNN GEMMs and torch's attention on one machine; tested). It does not make two servers with
different thread counts, machines or library versions agree, and sampling is reproducible only
with a ``sampling_seed`` (or greedy). Decode KV is never cached for invariant requests: a resent
reply is prefilled in chunks like any prompt text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers.cache_utils import DynamicCache

from services.inference.kv import layer_kv
from services.inference.prefix_cache import RadixPrefixCache

CHUNK_TOKENS = 128
"""Prefill chunk of the batch-invariant mode. Smaller chunks let the cache reuse more of a prompt but
cost a forward pass each: a 520-token prompt took 1.18x the time of a one-pass prefill at 128, 1.42x
at 64, 1.08x at 256 (SmolLM2, one thread, best of 4)."""

Forward = Callable[..., torch.Tensor]
"""The model's forward pass returning logits (the engine's ``_forward``)."""


def whole_chunks(tokens: int, chunk: int) -> int:
    """The longest prefix of ``tokens`` that is made of whole chunks.

    >>> whole_chunks(300, 128), whole_chunks(127, 128), whole_chunks(256, 128)
    (256, 0, 256)
    """
    return tokens // chunk * chunk


def canonical_prefill(
    forward: Forward,
    config: Any,
    ids: Sequence[int],
    cache: RadixPrefixCache,
    *,
    chunk: int = CHUNK_TOKENS,
    all_logits: bool = False,
) -> tuple[int, DynamicCache, torch.Tensor]:
    """Prefill ``ids`` in canonical chunks, reusing and then adding whole chunks of ``cache``.

    Args:
        forward: The model's forward pass (keyword arguments of a Hugging Face causal LM).
        config: The model's config (for the KV cache).
        ids: The prompt.
        cache: The radix cache of canonical chunks (holds nothing else).
        chunk: Tokens per chunk; one server must always use the same value.
        all_logits: Return the logits of every prompt position (for input logprobs; the cache is
            then not read, since cached positions have no logits) instead of the last one only.

    Returns:
        ``(tokens reused from the cache, the prompt's KV cache, logits)``: logits ``[len(ids), vocab]``
        with ``all_logits``, else ``[1, vocab]`` for the last position.
    """
    reused, prefix = (0, None) if all_logits else cache.match(ids)
    reused = whole_chunks(reused, chunk)
    kv = DynamicCache(config=config)
    if reused and prefix is not None:
        for layer, (keys, values) in enumerate(prefix):
            kv.update(keys[:, :, :reused], values[:, :, :reused], layer)
    pieces: list[torch.Tensor] = []
    for start in range(reused, len(ids), chunk):
        end = min(start + chunk, len(ids))
        pieces.append(
            forward(
                input_ids=torch.tensor([list(ids[start:end])], dtype=torch.long),
                cache=kv,
                position_ids=torch.arange(start, end).unsqueeze(0),
                logits_to_keep=0 if all_logits else 1,
            )[0]
        )
    whole = whole_chunks(len(ids), chunk)
    if whole:
        cache.insert(ids[:whole], [layer_kv(layer) for layer in kv.layers])
    logits = torch.cat(pieces) if all_logits else pieces[-1]
    return reused, kv, logits
