"""The left-padded batch KV cache: merging, growth, dropping and trimming rows."""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache

from services.inference.kv import KVBatch, _kv

LAYERS, HEADS, DIM = 2, 3, 4


def _prefilled(length: int, fill: float) -> DynamicCache:
    cache = DynamicCache()
    for layer in range(LAYERS):
        k = torch.full((1, HEADS, length, DIM), fill + layer)
        cache.update(k, -k, layer)
    return cache


def _keys(batch: KVBatch, layer: int) -> torch.Tensor:
    assert batch.cache is not None
    return _kv(batch.cache.layers[layer])[0]


def test_rows_are_right_aligned_and_masked() -> None:
    batch = KVBatch()
    batch.add_rows([_prefilled(3, 1.0), _prefilled(5, 2.0)])
    assert (batch.rows, batch.length) == (2, 5)
    assert batch.mask.tolist() == [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]
    keys = _keys(batch, 1)
    assert keys.shape == (2, HEADS, 5, DIM)
    assert torch.all(keys[0, :, :2] == 0) and torch.all(keys[0, :, 2:] == 2.0)
    assert torch.all(keys[1] == 3.0)


def test_a_longer_newcomer_repads_the_running_rows() -> None:
    batch = KVBatch()
    batch.add_rows([_prefilled(2, 1.0)])
    batch.add_rows([_prefilled(4, 5.0)])
    assert batch.mask.tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]]
    keys = _keys(batch, 0)
    assert torch.all(keys[0, :, 2:] == 1.0) and torch.all(keys[0, :, :2] == 0)


def test_decode_appends_in_place_beyond_the_initial_capacity() -> None:
    batch = KVBatch()
    batch.add_rows([_prefilled(2, 1.0), _prefilled(3, 1.0)])
    for step in range(100):  # more than the preallocated headroom
        batch.step_mask()
        for layer in range(LAYERS):
            new = torch.full((2, HEADS, 1, DIM), float(step))
            batch.cache.update(new, new, layer)  # type: ignore[union-attr]
    assert batch.length == 103
    assert batch.cache.get_seq_length() == 103  # type: ignore[union-attr]
    assert torch.all(_keys(batch, 0)[:, :, -1] == 99.0)


def test_dropping_rows_trims_columns_that_became_padding() -> None:
    batch = KVBatch()
    batch.add_rows([_prefilled(2, 1.0), _prefilled(6, 2.0), _prefilled(4, 3.0)])
    batch.keep_rows([0, 2])
    assert batch.mask.tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]]
    keys = _keys(batch, 0)
    assert keys.shape[2] == 4 and torch.all(keys[1] == 3.0)
    batch.keep_rows([])
    assert batch.rows == 0 and batch.cache is None


def _speculative_step(batch: KVBatch, fed: list[int], kept: list[int], width: int, values: list[list[float]]) -> None:
    """A speculative step: ``width`` columns a row, row ``i`` feeding ``fed[i]`` and keeping ``kept[i]``."""
    batch.spec_mask(fed, width)
    for layer in range(LAYERS):
        new = torch.tensor(values).view(len(fed), 1, width, 1).expand(len(fed), HEADS, width, DIM).contiguous()
        batch.cache.update(new, new, layer)  # type: ignore[union-attr]
    for row, count in enumerate(kept):
        batch.refuse(row, count, width)


def test_refused_draft_positions_are_masked_out_and_a_rows_real_kv_skips_them() -> None:
    batch = KVBatch()
    batch.add_rows([_prefilled(2, 1.0), _prefilled(3, 2.0)])
    # Row 0 feeds 3 positions and keeps 1 (its next token); row 1 feeds 2 of the 3 and keeps both.
    _speculative_step(batch, fed=[3, 2], kept=[1, 2], width=3, values=[[10, 11, 12], [20, 21, 22]])
    assert batch.mask.tolist() == [[0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0]]
    assert batch.slack == 1
    keys = batch.row_kv(0)[0][0]  # layer 0's keys of row 0: its 2 prompt positions and the kept one
    assert keys[0, 0, :, 0].tolist() == [1.0, 1.0, 10.0]
    # A plain decode step after it: the holes stay masked, the new column is real for both rows.
    batch.step_mask()
    for layer in range(LAYERS):
        new = torch.full((2, HEADS, 1, DIM), 30.0)
        batch.cache.update(new, new, layer)  # type: ignore[union-attr]
    assert batch.row_kv(0)[1][0][0, 0, :, 0].tolist() == [2.0, 2.0, 10.0, 30.0]
    assert batch.row_kv(0, tokens=3)[1][0][0, 0, :, 0].tolist() == [2.0, 2.0, 10.0]


def test_compacting_drops_the_refused_columns_and_keeps_every_rows_real_kv() -> None:
    batch = KVBatch()
    batch.add_rows([_prefilled(2, 1.0), _prefilled(3, 2.0)])
    _speculative_step(batch, fed=[4, 4], kept=[1, 3], width=4, values=[[10, 11, 12, 13], [20, 21, 22, 23]])
    _speculative_step(batch, fed=[2, 1], kept=[2, 1], width=2, values=[[14, 15], [24, 25]])
    before = [[k[0, 0, :, 0].tolist() for k, _ in batch.row_kv(row)] for row in range(2)]
    assert before[0][0] == [1.0, 1.0, 10.0, 14.0, 15.0]
    assert before[1][0] == [2.0, 2.0, 2.0, 20.0, 21.0, 22.0, 24.0]
    batch.compact()
    assert batch.slack == 0 and batch.length == 7
    assert batch.mask.tolist() == [[0, 0, 1, 1, 1, 1, 1], [1] * 7]
    assert [[k[0, 0, :, 0].tolist() for k, _ in batch.row_kv(row)] for row in range(2)] == before
    values = [v[0, 0, :, 0].tolist() for _, v in batch.row_kv(1)]
    assert values[1] == [-3.0, -3.0, -3.0, 20.0, 21.0, 22.0, 24.0]  # values move with their keys
