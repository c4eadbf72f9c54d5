"""The running batch's KV cache: one left-padded, preallocated buffer per layer.

Design (the batching engine's memory layout):

- Every active sequence is a row of a ``[rows, kv_heads, capacity, head_dim]`` buffer per layer. Rows
  are right-aligned: all rows share the same cache length ``T`` and a shorter sequence is padded on
  the left with zeros, masked out by a ``[rows, T]`` attention mask. Each row carries its own
  position ids, so padding never shifts RoPE positions.
- A new sequence is prefilled alone (batch of one, no padding, exactly a teacher-forced forward
  pass) and then merged into the batch (:meth:`KVBatch.add_rows`), re-padding to the longer length.
- Decoding appends one column for all rows in place (no per-step copy of the whole cache, unlike
  ``DynamicCache``'s ``torch.cat``); capacity grows geometrically.
- Finished rows are dropped (:meth:`KVBatch.keep_rows`) and leading columns that became padding
  for every remaining row are trimmed, so a long finished sequence does not keep costing attention.
- A speculative step appends several columns at once (a row's next token and its draft,
  :meth:`KVBatch.spec_mask`); the drafted positions the sampler refuses are masked out where they
  lie (:meth:`KVBatch.refuse`), so a row's real positions may have holes, until
  :meth:`KVBatch.compact` right-aligns them again.

Padded key/value slots hold zeros and are masked with ``-inf`` scores, so they get exactly zero
attention weight: batching changes a sequence's logprobs only by floating-point reassociation.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

_GROWTH = 64


def _kv(layer: object) -> tuple[torch.Tensor, torch.Tensor]:
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
        """Append sequences prefilled alone (one ``DynamicCache`` of batch 1 each) as new rows."""
        if not caches:
            return
        lengths = [c.get_seq_length() for c in caches]
        new_len = max([self.length, *lengths])
        n_old, n_total = self.rows, self.rows + len(caches)
        n_layers = len(caches[0].layers)
        layers: list[_BufferLayer] = []
        old_layers = self._layers() if self.cache is not None and n_old else []
        for li in range(n_layers):
            sample, _ = _kv(caches[0].layers[li])
            shape = (n_total, sample.shape[1], new_len + _GROWTH, sample.shape[3])
            k = torch.zeros(shape, dtype=sample.dtype)
            v = torch.zeros(shape, dtype=sample.dtype)
            if old_layers:
                old_k, old_v = _kv(old_layers[li])
                k[:n_old, :, new_len - self.length : new_len] = old_k
                v[:n_old, :, new_len - self.length : new_len] = old_v
            for i, (c, length) in enumerate(zip(caches, lengths, strict=True)):
                new_k, new_v = _kv(c.layers[li])
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

    def row_kv(self, row: int, tokens: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One row's real (unmasked) KV, per layer, each ``[1, kv_heads, tokens, head_dim]``.

        Args:
            row: The row.
            tokens: Only its first ``tokens`` real positions (None: all of them).

        A row's real positions are the contiguous tail of the buffer (views, no copy) unless a
        speculative step left refused draft positions masked out among them (then gathered, a copy).
        """
        if self.cache is None:
            return []
        real = self.mask[row].nonzero().squeeze(1)
        if tokens is not None:
            real = real[:tokens]
        used = int(real.numel())
        start = int(real[0].item()) if used else self.length
        contiguous = used == 0 or int(real[-1].item()) - start == used - 1
        where: slice | torch.Tensor = slice(start, start + used) if contiguous else real  # views, or a gather
        rows = slice(row, row + 1)
        return [(layer.k_buf[rows, :, where], layer.v_buf[rows, :, where]) for layer in self._layers()]

    def step_mask(self) -> torch.Tensor:
        """The attention mask for one decode step (every row gets one more real token)."""
        self.mask = torch.cat([self.mask, torch.ones((self.rows, 1), dtype=torch.long)], dim=1)
        return self.mask

    def spec_mask(self, fed: list[int], width: int) -> torch.Tensor:
        """The attention mask for a speculative step of ``width`` positions a row, row ``i`` feeding
        ``fed[i]`` real ones (its next token and its draft; the rest is padding, masked out).

        The buffer gains ``width`` columns for every row; :meth:`refuse` masks out the drafted
        positions the sampler then refused.
        """
        added = torch.zeros((self.rows, width), dtype=torch.long)
        for i, count in enumerate(fed):
            added[i, :count] = 1
        self.mask = torch.cat([self.mask, added], dim=1)
        return self.mask

    def refuse(self, row: int, kept: int, width: int) -> None:
        """After a speculative step of ``width`` columns, keep only the first ``kept`` of ``row``'s."""
        self.mask[row, self.length - width + kept :] = 0

    @property
    def slack(self) -> int:
        """Columns beyond the longest row's real positions: what refused drafts left masked out."""
        if not self.rows:
            return 0
        return self.length - int(self.mask.sum(dim=1).max().item())

    def compact(self) -> None:
        """Right-align every row's real positions again, dropping the columns refused drafts left.

        One copy of the whole cache; the engine calls it when the refused columns reach a fraction of
        the cache (attention reads every column).
        """
        if self.cache is None or not self.rows:
            return
        real = [self.mask[i].nonzero().squeeze(1) for i in range(self.rows)]
        new_len = max(int(r.numel()) for r in real)
        mask = torch.zeros((self.rows, new_len), dtype=torch.long)
        for layer in self._layers():
            shape = (self.rows, layer.k_buf.shape[1], new_len + _GROWTH, layer.k_buf.shape[3])
            k = torch.zeros(shape, dtype=layer.k_buf.dtype)
            v = torch.zeros(shape, dtype=layer.v_buf.dtype)
            for i, columns in enumerate(real):
                n = int(columns.numel())
                k[i, :, new_len - n : new_len] = layer.k_buf[i, :, columns]
                v[i, :, new_len - n : new_len] = layer.v_buf[i, :, columns]
            layer.k_buf, layer.v_buf, layer.length = k, v, new_len
            layer._sync()
        for i, columns in enumerate(real):
            mask[i, new_len - int(columns.numel()) :] = 1
        self.mask = mask
