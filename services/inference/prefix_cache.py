"""Prefix cache: reuse the KV of a prompt's longest cached prefix instead of recomputing it.

SPADE's traffic repeats prefixes: the G plays of one environment share their first prompt, and a
multi-turn episode resends the whole conversation every turn. Like SGLang's radix cache (in a much
simpler form), the engine keeps the prompt KV of recent requests and, on admission, prefills only
the part of a new prompt after its longest match.

Entries are whole prompts, least recently used first out, bounded by a total token budget. At least
one prompt token is always recomputed (its logits are needed to sample the first output token).
The cache depends on the weights: the engine clears it when it swaps them, and ``/flush_cache``
clears it. Thread-safe (the scheduler reads and writes it, ``/flush_cache`` clears it).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import torch

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values, each [1, heads, tokens, dim]


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    """LRU cache of prompt KV, matched by longest common prefix.

    Args:
        max_tokens: total prompt tokens held (memory is about 46 KB per token for SmolLM2-135M in
            float32); 0 disables the cache.
        min_match: shortest prefix worth reusing.
    """

    def __init__(self, max_tokens: int, min_match: int = 4) -> None:
        self.max_tokens = max_tokens
        self.min_match = min_match
        self._entries: OrderedDict[tuple[int, ...], KV] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()

    @property
    def tokens(self) -> int:
        """Prompt tokens currently held."""
        return self._tokens

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, ids: Sequence[int]) -> tuple[int, KV | None]:
        """The reusable prefix length for ``ids`` and its KV (sliced views), or ``(0, None)``."""
        if self.max_tokens <= 0:
            return 0, None
        with self._lock:
            best, best_key = 0, None
            for key in self._entries:
                if key[0] != ids[0]:
                    continue
                length = common_prefix_length(key, ids)
                if length > best:
                    best, best_key = length, key
            usable = min(best, len(ids) - 1)
            if best_key is None or usable < self.min_match:
                return 0, None
            self._entries.move_to_end(best_key)
            kv = self._entries[best_key]
        return usable, [(k[:, :, :usable], v[:, :, :usable]) for k, v in kv]

    def insert(self, ids: Sequence[int], kv: KV) -> None:
        """Remember the KV of prompt ``ids`` (tensors are kept, not copied: they must not be mutated)."""
        key = tuple(ids)
        if self.max_tokens <= 0 or len(key) > self.max_tokens:
            return
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return
            # A cached prompt that is a prefix of this one is superseded by it.
            for old in [k for k in self._entries if len(k) < len(key) and key[: len(k)] == k]:
                del self._entries[old]
                self._tokens -= len(old)
            self._entries[key] = kv
            self._tokens += len(key)
            while self._tokens > self.max_tokens:
                old, _ = self._entries.popitem(last=False)
                self._tokens -= len(old)

    def clear(self) -> None:
        """Drop every entry (after a weight swap the cached KV is wrong)."""
        with self._lock:
            self._entries.clear()
            self._tokens = 0
