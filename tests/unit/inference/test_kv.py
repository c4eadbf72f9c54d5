"""The left-padded batch KV cache: merging, growth, dropping and trimming rows."""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import DynamicCache

from services.inference.kv import KVBatch, layer_kv

LAYERS, HEADS, DIM = 2, 3, 4


@pytest.fixture(autouse=True)
def _poisoned_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fresh buffers hold NaN, not whatever the allocator returns: a padding slot left unwritten shows."""
    empty = torch.empty

    def poisoned(*args: object, **kwargs: object) -> torch.Tensor:
        return empty(*args, **kwargs).fill_(float("nan"))  # type: ignore[call-overload]

    monkeypatch.setattr(torch, "empty", poisoned)


def _prefilled(length: int, fill: float) -> DynamicCache:
    cache = DynamicCache()
    for layer in range(LAYERS):
        k = torch.full((1, HEADS, length, DIM), fill + layer)
        cache.update(k, -k, layer)
    return cache


def _keys(batch: KVBatch, layer: int) -> torch.Tensor:
    assert batch.cache is not None
    return layer_kv(batch.cache.layers[layer])[0]


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


def _storage(batch: KVBatch) -> int:
    return _keys(batch, 0).untyped_storage().data_ptr()


def test_a_newcomer_no_longer_than_the_batch_moves_into_a_spare_row_over_zeros() -> None:
    batch = KVBatch()
    batch.add_rows([_prefilled(6, 1.0), _prefilled(6, 2.0), _prefilled(6, 3.0)])
    storage = _storage(batch)
    batch.keep_rows([0, 2])  # row 2's values now also lie in the spare row beyond the batch
    batch.add_rows([_prefilled(2, 7.0)])
    assert _storage(batch) == storage  # written in place: the batch was not copied
    assert batch.mask.tolist() == [[1] * 6, [1] * 6, [0, 0, 0, 0, 1, 1]]
    for layer in range(LAYERS):
        keys, values = layer_kv(batch.cache.layers[layer])  # type: ignore[union-attr]
        assert torch.all(keys[0] == 1.0 + layer) and torch.all(keys[1] == 3.0 + layer)
        # the dropped row's and the moved row's values are gone from the newcomer's padding
        assert torch.all(keys[2, :, :4] == 0) and torch.all(values[2, :, :4] == 0)
        assert torch.all(keys[2, :, 4:] == 7.0 + layer) and torch.all(values[2, :, 4:] == -(7.0 + layer))


def test_dropping_rows_in_order_moves_the_later_rows_down_in_place() -> None:
    batch = KVBatch()
    batch.add_rows([_prefilled(6, 1.0), _prefilled(3, 2.0), _prefilled(4, 3.0), _prefilled(2, 4.0)])
    storage = _storage(batch)
    batch.keep_rows([1, 3])
    assert _storage(batch) == storage
    assert batch.mask.tolist() == [[1, 1, 1], [0, 1, 1]]
    keys = _keys(batch, 1)
    assert keys.shape == (2, HEADS, 3, DIM)
    assert torch.all(keys[0] == 3.0) and torch.all(keys[1, :, 1:] == 5.0) and torch.all(keys[1, :, 0] == 0)
    values = layer_kv(batch.cache.layers[1])[1]  # type: ignore[union-attr]
    assert torch.all(values[0] == -3.0) and torch.all(values[1, :, 1:] == -5.0) and torch.all(values[1, :, 0] == 0)


def test_dropping_rows_out_of_order_gathers_them() -> None:
    batch = KVBatch()
    batch.add_rows([_prefilled(2, 1.0), _prefilled(5, 2.0), _prefilled(3, 3.0)])
    batch.keep_rows([2, 0])
    assert batch.mask.tolist() == [[1, 1, 1], [0, 1, 1]]
    keys = _keys(batch, 0)
    assert torch.all(keys[0] == 3.0) and torch.all(keys[1, :, 1:] == 1.0) and torch.all(keys[1, :, 0] == 0)


def test_decoding_after_a_trim_grows_the_buffer_and_keeps_every_row() -> None:
    batch = KVBatch()
    batch.add_rows([_prefilled(40, 1.0), _prefilled(3, 2.0), _prefilled(5, 3.0)])
    batch.keep_rows([1, 2])  # the long row goes: 35 leading columns become a view's offset
    for step in range(80):  # past the buffer's end, which the offset brought nearer
        batch.step_mask()
        for layer in range(LAYERS):
            new = torch.full((2, HEADS, 1, DIM), 100.0 + step)
            batch.cache.update(new, new, layer)  # type: ignore[union-attr]
    keys = _keys(batch, 0)
    assert batch.length == 85 and keys.shape[2] == 85
    assert torch.all(keys[0, :, :2] == 0) and torch.all(keys[0, :, 2:5] == 2.0)
    assert torch.all(keys[1, :, :5] == 3.0)
    assert torch.equal(keys[:, 0, 5:, 0], (100.0 + torch.arange(80.0)).expand(2, 80))


def test_a_longer_newcomer_widens_the_batch_in_place_over_zeros() -> None:
    batch = KVBatch()
    batch.add_rows([_prefilled(90, 1.0), _prefilled(10, 2.0)])
    batch.keep_rows([1])  # 80 columns trimmed: the running row's old values lie before its view
    storage = _storage(batch)
    batch.add_rows([_prefilled(50, 5.0)])  # 40 columns longer than the batch
    assert _storage(batch) == storage
    assert batch.mask.tolist() == [[0] * 40 + [1] * 10, [1] * 50]
    for layer in range(LAYERS):
        keys, values = layer_kv(batch.cache.layers[layer])  # type: ignore[union-attr]
        assert keys.shape == (2, HEADS, 50, DIM)
        assert torch.all(keys[0, :, :40] == 0) and torch.all(values[0, :, :40] == 0)  # not the dropped row's
        assert torch.all(keys[0, :, 40:] == 2.0 + layer) and torch.all(keys[1] == 5.0 + layer)


def test_a_newcomer_beyond_the_headroom_repads_every_row_into_a_new_buffer() -> None:
    batch = KVBatch()
    batch.add_rows([_prefilled(70, 1.0), _prefilled(3, 2.0)])  # 64 spare leading columns
    storage = _storage(batch)
    batch.add_rows([_prefilled(140, 5.0)])  # 70 columns longer than the batch: more than the headroom
    assert _storage(batch) != storage
    assert batch.mask.tolist() == [[0] * 70 + [1] * 70, [0] * 137 + [1] * 3, [1] * 140]
    for layer in range(LAYERS):
        keys, values = layer_kv(batch.cache.layers[layer])  # type: ignore[union-attr]
        assert torch.all(keys[0, :, :70] == 0) and torch.all(values[0, :, :70] == 0)
        assert torch.all(keys[1, :, :137] == 0) and torch.all(values[1, :, :137] == 0)
        assert torch.all(keys[0, :, 70:] == 1.0 + layer) and torch.all(values[1, :, 137:] == -(2.0 + layer))
        assert torch.all(keys[2] == 5.0 + layer)


def test_a_bf16_batch_rounds_what_it_merges_and_appends_once_and_keeps_it_through_drops_and_growth() -> None:
    # The engine's shared lane keeps its KV in bf16 where its steps attend to it so: every value merged or
    # appended is rounded to bf16 on the way in, and nothing the batch does afterwards changes it.
    exact = 1.0 + 2.0**-12  # not a bf16 value: rounds to 1.0
    batch = KVBatch(torch.bfloat16)
    batch.add_rows([_prefilled(3, exact), _prefilled(5, 2.0)])
    assert batch.cache is not None
    for layer in range(LAYERS):
        keys, values = layer_kv(batch.cache.layers[layer])
        assert keys.dtype == values.dtype == torch.bfloat16
        assert torch.all(keys[0, :, 2:] == torch.tensor(exact + layer).bfloat16())
        assert torch.all(keys[0, :, :2] == 0) and torch.all(values[0, :, :2] == 0)
    assert torch.tensor(exact).bfloat16().item() != exact
    # A decode step appends fp32 keys and values: rounded into the batch's columns.
    step = torch.full((2, HEADS, 1, DIM), exact)
    batch.step_mask()
    for layer in range(LAYERS):
        keys, values = batch.cache.layers[layer].update(step, -step)  # type: ignore[union-attr]
        assert keys.dtype == torch.bfloat16 and torch.all(keys[:, :, -1] == 1.0) and torch.all(values[:, :, -1] == -1.0)
    # A newcomer longer than the batch re-pads in place, then a drop: the dtype and values stay.
    batch.add_rows([_prefilled(9, 7.0)])
    batch.keep_rows([1, 2])
    assert batch.mask.tolist() == [[0, 0, 0] + [1] * 6, [1] * 9]
    for layer in range(LAYERS):
        keys, values = layer_kv(batch.cache.layers[layer])
        assert keys.dtype == torch.bfloat16
        assert torch.all(keys[0, :, 3:8] == 2.0 + layer) and torch.all(keys[0, :, 8] == 1.0)
        assert torch.all(values[1] == -(7.0 + layer)) and torch.all(keys[0, :, :3] == 0)
    # A row's KV comes out as the batch holds it: the prefix cache rounds nothing further (it converts).
    assert all(k.dtype == torch.bfloat16 for k, _ in batch.row_kv(1))


def test_a_batch_without_a_dtype_keeps_what_it_is_given() -> None:
    batch = KVBatch()
    batch.add_rows([_prefilled(3, 1.0 + 2.0**-12)])
    assert _keys(batch, 0).dtype == torch.float32 and torch.all(_keys(batch, 0) == 1.0 + 2.0**-12)
