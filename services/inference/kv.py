"""The running batch's KV cache: one left-padded, preallocated buffer per layer.

Design (the batching engine's memory layout):

- Every active sequence is a row of a ``[rows, kv_heads, capacity, head_dim]`` buffer per layer. Rows
  are right-aligned: all rows share the same cache length ``T`` and a shorter sequence is padded on
  the left with zeros, masked out by a ``[rows, T]`` attention mask. Each row carries its own
  position ids, so padding never shifts RoPE positions.
- A new sequence is prefilled (alone, or beside other short prompts in this same layout,
  :mod:`services.inference.prefill`) and then merged into the batch (:meth:`KVBatch.add_rows`),
  re-padding to the longer length.
- Decoding appends one column for all rows in place (no per-step copy of the whole cache, unlike
  ``DynamicCache``'s ``torch.cat``); capacity grows geometrically.
- Finished rows are dropped (:meth:`KVBatch.keep_rows`) and leading columns that became padding
  for every remaining row are trimmed, so a long finished sequence does not keep costing attention.

Padded key/value slots hold zeros and are masked with ``-inf`` scores, so they get exactly zero
attention weight: batching changes a sequence's logprobs only by floating-point reassociation.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

_GROWTH = 64


def layer_kv(layer: object) -> tuple[torch.Tensor, torch.Tensor]:
    """The key and value tensors of an initialised cache layer."""
    keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
    if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
        raise TypeError(f"cache layer {type(layer).__name__} holds no key/value tensors")
    return keys, values


class _BufferLayer(DynamicLayer):
    """A cache layer backed by a preallocated buffer; ``keys``/``values`` are views of its prefix."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        super().__init__()
        self.k_buf, self.v_buf, self.length = keys, values, length
        self.device = keys.device
        self.dtype = keys.dtype
        self.is_initialized = True
        self._sync()

    def _sync(self) -> None:
        self.keys = self.k_buf[:, :, : self.length]
        self.values = self.v_buf[:, :, : self.length]

    def _reserve(self, needed: int) -> None:
        capacity = self.k_buf.shape[2]
        if needed <= capacity:
            return
        new_capacity = max(needed, capacity + max(_GROWTH, capacity // 2))
        shape = (*self.k_buf.shape[:2], new_capacity, self.k_buf.shape[3])
        k = torch.zeros(shape, dtype=self.k_buf.dtype, device=self.device)
        v = torch.zeros(shape, dtype=self.v_buf.dtype, device=self.device)
        k[:, :, : self.length] = self.k_buf[:, :, : self.length]
        v[:, :, : self.length] = self.v_buf[:, :, : self.length]
        self.k_buf, self.v_buf = k, v

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n, q = self.length, key_states.shape[-2]
        self._reserve(n + q)
        self.k_buf[:, :, n : n + q] = key_states
        self.v_buf[:, :, n : n + q] = value_states
        self.length = n + q
        self._sync()
        return self.k_buf[:, :, : self.length], self.v_buf[:, :, : self.length]

    def get_seq_length(self) -> int:
        return self.length


class KVBatch:
    """The KV cache and attention mask of the running batch (see the module docstring)."""

    def __init__(self) -> None:
        self.cache: DynamicCache | None = None
        self.mask = torch.zeros((0, 0), dtype=torch.long)

    @property
    def rows(self) -> int:
        return int(self.mask.shape[0])

    @property
    def length(self) -> int:
        return int(self.mask.shape[1])

    def _layers(self) -> list[_BufferLayer]:
        assert self.cache is not None
        return [layer for layer in self.cache.layers if isinstance(layer, _BufferLayer)]

    def add_rows(self, caches: list[DynamicCache]) -> None:
        """Append prefilled sequences (one ``DynamicCache`` of batch 1 each) as new rows."""
        if not caches:
            return
        lengths = [c.get_seq_length() for c in caches]
        new_len = max([self.length, *lengths])
        n_old, n_total = self.rows, self.rows + len(caches)
        n_layers = len(caches[0].layers)
        layers: list[_BufferLayer] = []
        old_layers = self._layers() if self.cache is not None and n_old else []
        for li in range(n_layers):
            sample, _ = layer_kv(caches[0].layers[li])
            shape = (n_total, sample.shape[1], new_len + _GROWTH, sample.shape[3])
            k = torch.zeros(shape, dtype=sample.dtype)
            v = torch.zeros(shape, dtype=sample.dtype)
            if old_layers:
                old_k, old_v = layer_kv(old_layers[li])
                k[:n_old, :, new_len - self.length : new_len] = old_k
                v[:n_old, :, new_len - self.length : new_len] = old_v
            for i, (c, length) in enumerate(zip(caches, lengths, strict=True)):
                new_k, new_v = layer_kv(c.layers[li])
                k[n_old + i, :, new_len - length : new_len] = new_k[0]
                v[n_old + i, :, new_len - length : new_len] = new_v[0]
            layers.append(_BufferLayer(k, v, new_len))
        mask = torch.zeros((n_total, new_len), dtype=torch.long)
        if n_old:
            mask[:n_old, new_len - self.length :] = self.mask
        for i, length in enumerate(lengths):
            mask[n_old + i, new_len - length :] = 1
        cache = DynamicCache()
        cache.layers = list(layers)
        self.cache, self.mask = cache, mask

    def keep_rows(self, keep: list[int]) -> None:
        """Keep only the rows at ``keep`` (in that order), then trim all-padding leading columns."""
        if not keep:
            self.cache, self.mask = None, torch.zeros((0, 0), dtype=torch.long)
            return
        index = torch.tensor(keep, dtype=torch.long)
        mask = self.mask[index]
        used = mask.any(dim=0).nonzero()
        start = int(used[0].item()) if used.numel() else mask.shape[1]
        for layer in self._layers():
            layer.k_buf = layer.k_buf[index, :, start:]
            layer.v_buf = layer.v_buf[index, :, start:]
            layer.length -= start
            layer._sync()
        self.mask = mask[:, start:]

    def row_kv(self, row: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Views of one row's real (unpadded) KV, per layer, each ``[1, kv_heads, tokens, head_dim]``.

        A row's real tokens are always the contiguous tail of the buffer (rows are right-aligned and
        every decode step appends one column to all rows).
        """
        if self.cache is None:
            return []
        used = int(self.mask[row].sum().item())
        return [
            (
                layer.k_buf[row : row + 1, :, layer.length - used : layer.length],
                layer.v_buf[row : row + 1, :, layer.length - used : layer.length],
            )
            for layer in self._layers()
        ]

    def step_mask(self) -> torch.Tensor:
        """The attention mask for one decode step (every row gets one more real token)."""
        self.mask = torch.cat([self.mask, torch.ones((self.rows, 1), dtype=torch.long)], dim=1)
        return self.mask
