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
- Neither copies the batch: the buffer is allocated with spare rows and spare columns before the
  batch's (:func:`_spare`). A newcomer goes into the next spare row; one longer
  than the batch moves the batch's first column left, zeroing the running rows' new padding. Dropping
  rows moves only the rows after the first dropped one down, in place, the trimmed columns becoming
  spare columns. Only a newcomer longer than the headroom allows, or a decode step past the buffer's
  end, re-pads every row into a new buffer.
  (Each merge or drop used to copy the whole cache into a fresh, zero-filled buffer: 60–140 ms a
  time at 4–8 rows of 1,500 tokens, about 3.7 s of scheduler time in a default ``make run``.)

Padded key/value slots hold zeros and are masked with ``-inf`` scores, so they get exactly zero
attention weight: batching changes a sequence's logprobs only by floating-point reassociation.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

_GROWTH = 64
"""Spare columns a new buffer holds beyond its rows' length (decode steps append in place), and at least
before them (:func:`_spare`)."""

_ROW_GROWTH = 4
"""Spare rows a new buffer holds at least (:func:`_spare`)."""


def _spare(used: int, least: int) -> int:
    """Spare room for ``used`` rows or columns: half as many again, at least ``least``.

    A buffer grows its columns so (decode steps past its end) and holds as many spare rows and, before its
    columns, spare columns, for newcomers (longer ones) to move into without a copy. Spare room is not
    written until used: where the allocator maps fresh pages (large buffers) it costs address space, not
    memory. Rows dropped in place stay resident until the buffer is next reallocated.
    """
    return max(least, used // 2)


def layer_kv(layer: object) -> tuple[torch.Tensor, torch.Tensor]:
    """The key and value tensors of an initialised cache layer."""
    keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
    if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
        raise TypeError(f"cache layer {type(layer).__name__} holds no key/value tensors")
    return keys, values


class _BufferLayer(DynamicLayer):
    """A cache layer backed by a preallocated buffer; ``keys``/``values`` are views of its prefix.

    ``k_all``/``v_all`` are the whole allocation, ``[row capacity, kv_heads, columns, head_dim]``;
    ``k_buf``/``v_buf`` the batch's view of it: its first ``rows`` rows, from column ``first`` on.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int, rows: int, first: int) -> None:
        super().__init__()
        self.k_all, self.v_all, self.length, self.first = keys, values, length, first
        self.device = keys.device
        self.dtype = keys.dtype
        self.is_initialized = True
        self._view(rows)

    def _view(self, rows: int) -> None:
        self.k_buf = self.k_all[:rows, :, self.first :]
        self.v_buf = self.v_all[:rows, :, self.first :]
        self._sync()

    def _sync(self) -> None:
        self.keys = self.k_buf[:, :, : self.length]
        self.values = self.v_buf[:, :, : self.length]

    def _reserve(self, needed: int) -> None:
        capacity = self.k_buf.shape[2]
        if needed <= capacity:
            return
        new_capacity = max(needed, capacity + _spare(capacity, _GROWTH))
        rows, first = self.k_buf.shape[0], _spare(self.length, _GROWTH)
        shape = (self.k_all.shape[0], self.k_buf.shape[1], first + new_capacity, self.k_buf.shape[3])
        k = torch.empty(shape, dtype=self.k_buf.dtype, device=self.device)
        v = torch.empty(shape, dtype=self.v_buf.dtype, device=self.device)
        k[:rows, :, first : first + self.length] = self.k_buf[:, :, : self.length]
        v[:rows, :, first : first + self.length] = self.v_buf[:, :, : self.length]
        self.k_all, self.v_all, self.first = k, v, first
        self._view(rows)

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

    def fits(self, rows: int, length: int) -> bool:
        """Whether ``rows`` rows of ``length`` columns fit the allocation as it is."""
        return rows <= self.k_all.shape[0] and length - self.length <= self.first

    def widen(self, length: int) -> None:
        """Move the first column left to hold ``length`` columns (:meth:`fits`), zeroing the running
        rows' new padding."""
        extra = length - self.length
        assert extra >= 0, f"widen cannot narrow the batch ({self.length} columns to {length})"
        if extra:
            rows = self.k_buf.shape[0]
            self.first -= extra
            self.k_all[:rows, :, self.first : self.first + extra] = 0
            self.v_all[:rows, :, self.first : self.first + extra] = 0
            self.length = length
            self._view(rows)

    def put(self, row: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write ``[rows, kv_heads, tokens, head_dim]`` keys and values, right-aligned, into the batch's
        ``length`` columns of the rows from ``row`` on, zeros before them."""
        rows, pad, start = slice(row, row + keys.shape[0]), self.length - keys.shape[2], self.first
        self.k_all[rows, :, start : start + pad] = 0
        self.v_all[rows, :, start : start + pad] = 0
        self.k_all[rows, :, start + pad : start + self.length] = keys
        self.v_all[rows, :, start + pad : start + self.length] = values


class KVBatch:
    """The KV cache and attention mask of the running batch (see the module docstring).

    Args:
        dtype: What the buffer keeps keys and values in, whatever the caches merged into it hold (each is
            rounded to it once, as it is written); ``None``: the first merged cache's dtype. The engine's
            shared lane keeps bf16 where its decode steps attend through the kernel to bf16
            (:attr:`.LlamaDecoder.kv_dtype`): half the bytes each step's attention reads.
    """

    def __init__(self, dtype: torch.dtype | None = None) -> None:
        self.dtype = dtype
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
        """Append prefilled sequences (one ``DynamicCache`` of batch 1 each) as new rows.

        Newcomers go into the buffer's spare rows in place, the batch widened into its spare columns
        where one is longer; where the buffer lacks either, every row is re-padded into a new one.
        """
        if not caches:
            return
        lengths = [c.get_seq_length() for c in caches]
        new_len = max([self.length, *lengths])
        n_old, n_total = self.rows, self.rows + len(caches)
        n_layers = len(caches[0].layers)
        old_layers = self._layers() if self.cache is not None and n_old else []
        if old_layers and old_layers[0].fits(n_total, new_len):
            for li, layer in enumerate(old_layers):
                layer.widen(new_len)
                for i, c in enumerate(caches):
                    layer.put(n_old + i, *layer_kv(c.layers[li]))
                layer._view(n_total)
            layers = old_layers
        else:
            layers = []
            capacity, first = n_total + _spare(n_total, _ROW_GROWTH), _spare(new_len, _GROWTH)
            for li in range(n_layers):
                sample, _ = layer_kv(caches[0].layers[li])
                shape = (capacity, sample.shape[1], first + new_len + _GROWTH, sample.shape[3])
                dtype = self.dtype or sample.dtype
                k_all, v_all = torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype)
                layer = _BufferLayer(k_all, v_all, new_len, n_total, first)
                if old_layers:
                    layer.put(0, *layer_kv(old_layers[li]))
                for i, c in enumerate(caches):
                    layer.put(n_old + i, *layer_kv(c.layers[li]))
                layers.append(layer)
        mask = torch.zeros((n_total, new_len), dtype=torch.long)
        if n_old:
            mask[:n_old, new_len - self.length :] = self.mask
        for i, length in enumerate(lengths):
            mask[n_old + i, new_len - length :] = 1
        cache = DynamicCache()
        cache.layers = list(layers)
        self.cache, self.mask = cache, mask

    def keep_rows(self, keep: list[int]) -> None:
        """Keep only the rows at ``keep`` (in that order), then trim all-padding leading columns.

        Kept in their order (``keep`` increasing, as the engine drops rows), the rows after the first
        dropped one move down in place; another order is gathered into a new buffer.
        """
        if not keep:
            self.cache, self.mask = None, torch.zeros((0, 0), dtype=torch.long)
            return
        index = torch.tensor(keep, dtype=torch.long)
        mask = self.mask[index]
        used = mask.any(dim=0).nonzero()
        start = int(used[0].item()) if used.numel() else mask.shape[1]
        in_order = all(a < b for a, b in itertools.pairwise(keep))
        for layer in self._layers():
            if in_order:
                first, last = layer.first + start, layer.first + layer.length
                for row, source in enumerate(keep):
                    if row != source:
                        layer.k_all[row, :, first:last] = layer.k_all[source, :, first:last]
                        layer.v_all[row, :, first:last] = layer.v_all[source, :, first:last]
                layer.first, layer.length = first, layer.length - start
            else:
                rows = layer.k_buf[index, :, start:]  # gathered, without headroom: a longer newcomer re-pads
                layer.k_all, layer.v_all = rows, layer.v_buf[index, :, start:]
                layer.first, layer.length = 0, layer.length - start
            layer._view(len(keep))
        self.mask = mask[:, start:]

    def row_kv(self, row: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Views of one row's real (unpadded) KV, per layer, each ``[1, kv_heads, tokens, head_dim]``, in the
        buffer's dtype.

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
