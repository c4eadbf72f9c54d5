"""Radix-tree prefix cache: reuse the KV of the longest cached prefix instead of recomputing it.

SPADE's traffic repeats prefixes: the G plays of one environment share their system prompt and the
env's rules, and a multi-turn episode resends its whole conversation every turn. Like SGLang's
``RadixCache`` (``sglang/srt/mem_cache/radix_cache.py``), the engine keeps the KV of prompts (and of
finished generations) in a radix tree over token ids: each edge holds a run of tokens and the KV of
exactly those tokens, so a prefix shared by many sequences is stored once, and a new prompt is
matched token by token against everything cached, also part-way into an edge.

- :meth:`RadixPrefixCache.match` returns the longest cached prefix of a prompt (capped one token
  short of the prompt: the last prompt token's logits are needed to sample) and its KV.
- :meth:`RadixPrefixCache.insert` adds a sequence's KV; only the part not already in the tree is
  copied (an edge is split where a new sequence diverges inside it).
- The tree holds at most ``max_tokens`` tokens. When over, the least recently used **leaf** is
  evicted, repeatedly (a parent whose last child went becomes a leaf, and so a candidate), so
  prefixes shared by recent requests are the last to go.

The cache depends on the weights: the engine clears it when it swaps them, and ``/flush_cache``
clears it. Tensors in the tree are never mutated (split edges are copied), so a match can hand out
views. Thread-safe (the scheduler reads and writes it, ``/flush_cache`` clears it from the event loop).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values, each [1, heads, tokens, dim]


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences.

    >>> common_prefix_length([1, 2, 3], [1, 2, 4])
    2
    """
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _slice(kv: KV, start: int, stop: int | None = None, *, copy: bool = False, dtype: torch.dtype | None = None) -> KV:
    """The KV of tokens ``start:stop`` (a copy when ``copy``, in ``dtype`` if given, so the source can be freed)."""
    out: KV = []
    for k, v in kv:
        ks, vs = k[:, :, start:stop], v[:, :, start:stop]
        if copy:
            ks, vs = ks.to(dtype or ks.dtype, copy=True), vs.to(dtype or vs.dtype, copy=True)
        out.append((ks, vs))
    return out


@dataclass(eq=False)
class _Node:
    """A radix-tree node: the edge from its parent carries ``tokens`` and their ``kv``."""

    tokens: tuple[int, ...]
    kv: KV
    parent: _Node | None
    children: dict[int, _Node] = field(default_factory=dict)
    last_access: int = 0


class RadixPrefixCache:
    """KV of cached token sequences in a radix tree, bounded by tokens, LRU eviction over leaves.

    Args:
        max_tokens: most tokens held in the tree (about 46 KB of KV per token for SmolLM2-135M in
            float32); 0 disables the cache.
        min_match: shortest prefix worth reusing (shorter matches are reported as no match).
        dtype: what the tree keeps KV in (``None``: as inserted). The engine's decode batch may hold bf16 KV
            (:class:`.kv.KVBatch`); a finished sequence's KV inserted from it has been rounded to bf16 once,
            and a later prompt that reuses it gets those values (reuse then changes logprobs by bf16
            rounding of the KV, not only fp32's), while prefills continue from KV of the model's dtype.
    """

    def __init__(self, max_tokens: int, min_match: int = 4, dtype: torch.dtype | None = None) -> None:
        self.max_tokens = max_tokens
        self.min_match = min_match
        #: What the tree keeps KV in (``None``: as inserted). The engine's decode batch may keep bf16
        #: (:class:`.kv.KVBatch`); its prefills continue from the tree's KV in the model's dtype.
        self.dtype = dtype
        self._root = _Node((), [], None)
        self._tokens = 0
        self._clock = itertools.count(1)
        self._lock = threading.Lock()

    @property
    def tokens(self) -> int:
        """Tokens currently held (the sum of all edge lengths)."""
        return self._tokens

    def __len__(self) -> int:
        """Number of nodes (edges) in the tree."""
        return sum(1 for _ in self._nodes()) - 1

    def _nodes(self) -> list[_Node]:
        out, stack = [], [self._root]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def _walk(self, ids: Sequence[int]) -> tuple[list[tuple[_Node, int]], int]:
        """The path matching ``ids`` as ``(node, tokens used of its edge)``, and the matched length."""
        path: list[tuple[_Node, int]] = []
        node, pos = self._root, 0
        while pos < len(ids):
            child = node.children.get(ids[pos])
            if child is None:
                break
            used = common_prefix_length(child.tokens, ids[pos : pos + len(child.tokens)])
            path.append((child, used))
            pos += used
            if used < len(child.tokens):
                break
            node = child
        return path, pos

    def match(self, ids: Sequence[int]) -> tuple[int, KV | None]:
        """The reusable prefix length of ``ids`` and its KV, or ``(0, None)``.

        At most ``len(ids) - 1`` tokens are reused, so at least one prompt token is computed.
        """
        if self.max_tokens <= 0 or len(ids) < 2:
            return 0, None
        limit = len(ids) - 1
        with self._lock:
            path, matched = self._walk(ids[:limit])
            if matched < self.min_match:
                return 0, None
            now = next(self._clock)
            parts: list[KV] = []
            for node, used in path:
                node.last_access = now
                parts.append(node.kv if used == len(node.tokens) else _slice(node.kv, 0, used))
        if len(parts) == 1:
            return matched, parts[0]
        layers = len(parts[0])
        kv = [
            (torch.cat([p[i][0] for p in parts], dim=2), torch.cat([p[i][1] for p in parts], dim=2))
            for i in range(layers)
        ]
        return matched, kv

    def insert(self, ids: Sequence[int], kv: KV) -> int:
        """Add the KV of sequence ``ids`` (``kv`` covers at least ``len(ids)`` tokens).

        Only the tokens not yet in the tree are copied out of ``kv`` (in the tree's ``dtype``), so ``kv`` may be
        a view of a buffer that is later reused. Returns the number of tokens added.
        """
        if self.max_tokens <= 0 or not ids or len(ids) > self.max_tokens:
            return 0
        with self._lock:
            now = next(self._clock)
            node, pos = self._root, 0
            while pos < len(ids):
                child = node.children.get(ids[pos])
                if child is None:
                    break
                used = common_prefix_length(child.tokens, ids[pos : pos + len(child.tokens)])
                if used < len(child.tokens) and pos + used < len(ids):
                    child = self._split(child, used)  # diverges inside the edge: branch there
                child.last_access = now
                node, pos = child, pos + used
            added = len(ids) - pos
            if added:
                added_kv = _slice(kv, pos, len(ids), copy=True, dtype=self.dtype)
                leaf = _Node(tuple(ids[pos:]), added_kv, node, last_access=now)
                node.children[ids[pos]] = leaf
                self._tokens += added
            self._evict()
            return added

    def _split(self, node: _Node, at: int) -> _Node:
        """Split ``node``'s edge after ``at`` tokens; returns the new upper node."""
        assert node.parent is not None and 0 < at < len(node.tokens)
        upper = _Node(node.tokens[:at], _slice(node.kv, 0, at, copy=True), node.parent, last_access=node.last_access)
        upper.children[node.tokens[at]] = node
        node.parent.children[node.tokens[0]] = upper
        node.tokens, node.kv, node.parent = node.tokens[at:], _slice(node.kv, at, copy=True), upper
        return upper

    def _evict(self) -> None:
        """Drop least recently used leaves until the tree fits ``max_tokens``."""
        if self._tokens <= self.max_tokens:
            return
        leaves = [n for n in self._nodes() if n is not self._root and not n.children]
        while self._tokens > self.max_tokens and leaves:
            leaf = min(leaves, key=lambda n: n.last_access)
            leaves.remove(leaf)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.tokens[0]]
            self._tokens -= len(leaf.tokens)
            if parent is not self._root and not parent.children:
                leaves.append(parent)

    def clear(self) -> None:
        """Drop every entry (after a weight swap the cached KV is wrong)."""
        with self._lock:
            self._root = _Node((), [], None)
            self._tokens = 0
