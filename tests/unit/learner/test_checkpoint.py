"""Checkpoints: exact round trip (tied weights included), atomic writes, retention, the optimizer state written
past the page cache."""

from __future__ import annotations

import ctypes
import errno
import io
import json
import mmap
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from services.learner.checkpoint import (
    CheckpointError,
    CheckpointManager,
    _DirectWriter,
    save_uncached,
    write_json_atomic,
)
from services.learner.core.losses import GrpoLossConfig, build_loss
from services.learner.trainer import OptimConfig, Trainer

from .conftest import VOCAB, random_batch


def tied_llama(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config)


def trained(seed: int) -> Trainer:
    trainer = Trainer(tied_llama(seed), build_loss(GrpoLossConfig()), OptimConfig(lr=1e-2))
    trainer.train_step(random_batch(seed=seed))
    return trainer


@pytest.mark.model
def test_round_trip_restores_model_optimizer_state_and_ties(tmp_path):
    source = trained(0)
    manager = CheckpointManager(tmp_path, keep=2)
    path = manager.save(7, source.model, source.optimizer, {"version": 7, "window": {"k": 2}})
    assert path is not None and path == tmp_path / "step-00000007"
    assert (path / "model" / "model.safetensors").is_file() and (path / "model" / "config.json").is_file()

    target = trained(1)  # different weights and optimizer moments
    restored = manager.load(target.model, target.optimizer)
    assert restored is not None and restored.step == 7
    assert restored.state == {"step": 7, "version": 7, "window": {"k": 2}}
    for (name, a), b in zip(source.model.state_dict().items(), target.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    model: Any = target.model
    assert model.lm_head.weight is model.model.embed_tokens.weight
    src_state = list(source.optimizer.state.values())
    dst_state = list(target.optimizer.state.values())
    for a, b in zip(src_state, dst_state, strict=True):
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])

    # The next step from the restored copy equals the next step of the original.
    batch = random_batch(seed=5)
    source.train_step(batch)
    target.train_step(batch)
    for a, b in zip(source.model.parameters(), target.model.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.model
def test_retention_keeps_the_newest(tmp_path):
    t = trained(0)
    manager = CheckpointManager(tmp_path, keep=2)
    for step in (1, 2, 3, 4):
        manager.save(step, t.model, t.optimizer, {})
    assert manager.steps() == [3, 4] and manager.latest() == 4
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.model
def test_a_failed_save_leaves_no_checkpoint_behind(tmp_path, monkeypatch):
    t = trained(0)
    manager = CheckpointManager(tmp_path, keep=3)
    manager.save(1, t.model, t.optimizer, {})

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", boom)
    with pytest.raises(OSError, match="disk full"):
        manager.save(2, t.model, t.optimizer, {})
    assert manager.steps() == [1]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.model
def test_missing_tensors_and_missing_checkpoints_are_errors(tmp_path):
    t = trained(0)
    manager = CheckpointManager(tmp_path)
    assert manager.load(t.model, t.optimizer) is None
    with pytest.raises(CheckpointError, match="no checkpoint"):
        manager.load(t.model, t.optimizer, step=3)
    path = manager.save(1, t.model, t.optimizer, {})
    assert path is not None
    from safetensors.torch import load_file, save_file

    weights = load_file(str(path / "model" / "model.safetensors"))
    weights.pop("model.norm.weight")
    save_file(weights, str(path / "model" / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"lacks 1 tensors"):
        manager.load(t.model, t.optimizer)
    with pytest.raises(CheckpointError, match="at least 1"):
        CheckpointManager(tmp_path, keep=0)


def test_write_json_atomic(tmp_path):
    target = tmp_path / "sub" / "state.json"
    write_json_atomic(target, {"a": 1})
    write_json_atomic(target, {"a": 2})
    assert json.loads(target.read_text()) == {"a": 2}
    assert [p.name for p in target.parent.iterdir()] == ["state.json"]


def _state() -> dict[str, Any]:
    """An optimizer-like state whose tensors and total size are no multiple of a block."""
    generator = torch.Generator().manual_seed(0)
    return {
        "state": {
            "w": {"step": torch.tensor(3.0), "exp_avg": torch.randn(250_007, generator=generator)},
            "b": {"step": torch.tensor(3.0), "exp_avg": torch.randn(17, generator=generator).bfloat16()},
        },
        "param_groups": [{"lr": 1e-6, "params": ["w", "b"]}],
    }


def _saved_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _cached_fraction(path: Path) -> float:
    """The share of ``path``'s pages in the page cache (``mincore`` over a read-only map: reads nothing)."""
    size = path.stat().st_size
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    pages = -(-size // mmap.PAGESIZE)
    vector = (ctypes.c_ubyte * pages)()
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert address not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
        try:
            assert libc.mincore(ctypes.c_void_p(address), size, vector) == 0, ctypes.get_errno()
        finally:
            libc.munmap(ctypes.c_void_p(address), size)
    finally:
        os.close(fd)
    return sum(v & 1 for v in vector) / pages


def _o_direct(directory: Path) -> bool | None:
    """Whether a block written with ``O_DIRECT`` in ``directory`` stays out of the page cache (False: the
    filesystem takes ``O_DIRECT`` but caches anyway, as tmpfs does); None: ``O_DIRECT`` refused."""
    probe = directory / ".probe"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    except (OSError, AttributeError):
        return None
    block = mmap.mmap(-1, 4096)
    try:
        os.write(fd, block)
    finally:
        block.close()
        os.close(fd)
    uncached = _cached_fraction(probe) == 0.0
    probe.unlink()
    return uncached


def test_the_optimizer_state_is_written_past_the_page_cache_with_torch_saves_bytes(tmp_path):
    state = _state()
    # A small buffer: the tensors' bytes span many buffer fills, and the file ends inside a block.
    direct = save_uncached(state, tmp_path / "optimizer.pt", buffer_bytes=64 << 10)
    assert direct == (_o_direct(tmp_path) is not None)
    written = (tmp_path / "optimizer.pt").read_bytes()
    assert written == _saved_bytes(state) and len(written) % 4096 != 0
    loaded = torch.load(tmp_path / "optimizer.pt", weights_only=False)
    assert torch.equal(loaded["state"]["w"]["exp_avg"], state["state"]["w"]["exp_avg"])
    assert loaded["state"]["b"]["exp_avg"].dtype == torch.bfloat16 and loaded["param_groups"] == state["param_groups"]


def test_an_uncached_save_leaves_the_file_out_of_the_page_cache(tmp_path):
    if not _o_direct(tmp_path):
        pytest.skip(f"{tmp_path}'s filesystem refuses O_DIRECT or caches what it writes")
    state = _state()
    assert save_uncached(state, tmp_path / "optimizer.pt")
    assert _cached_fraction(tmp_path / "optimizer.pt") < 0.1
    torch.save(state, tmp_path / "cached.pt")  # the filesystem caches a plain write
    assert _cached_fraction(tmp_path / "cached.pt") > 0.9


def test_the_direct_writer_writes_whole_blocks_at_block_offsets(tmp_path, monkeypatch):
    # On a plain descriptor, so that it runs whatever the filesystem: every write O_DIRECT would see.
    writes: list[tuple[int, int]] = []
    real_write = os.write

    def recorded(fd: int, data: Any) -> int:
        writes.append((os.lseek(fd, 0, os.SEEK_CUR), len(data)))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", recorded)
    state = _state()
    writer = _DirectWriter(os.open(tmp_path / "optimizer.pt", os.O_WRONLY | os.O_CREAT, 0o644), 64 << 10)
    try:
        torch.save(state, writer)  # type: ignore[arg-type]
        writer.finish()
    finally:
        writer.close()
    assert len(writes) > 10 and all(offset % 4096 == 0 and length % 4096 == 0 for offset, length in writes)
    assert (tmp_path / "optimizer.pt").read_bytes() == _saved_bytes(state)


def test_a_write_refused_midway_is_written_again_through_the_cache(tmp_path, monkeypatch):
    # A device that refuses O_DIRECT's alignment at the first write (EINVAL), after torch has begun.
    opens = _o_direct(tmp_path) is not None
    refused: list[int] = []

    def refuse(fd: int, data: Any) -> int:
        refused.append(len(data))
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(os, "write", refuse)
    state = _state()
    assert not save_uncached(state, tmp_path / "optimizer.pt", buffer_bytes=64 << 10)
    assert bool(refused) == opens  # where O_DIRECT opens, the refusal came mid-stream
    assert (tmp_path / "optimizer.pt").read_bytes() == _saved_bytes(state)


def test_other_write_errors_are_raised(tmp_path, monkeypatch):
    if _o_direct(tmp_path) is None:
        pytest.skip(f"{tmp_path}'s filesystem refuses O_DIRECT")

    def full(fd: int, data: Any) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(OSError, match="No space left"):
        save_uncached(_state(), tmp_path / "optimizer.pt", buffer_bytes=64 << 10)


def test_without_o_direct_the_same_bytes_go_through_the_cache(tmp_path, monkeypatch):
    # A platform without O_DIRECT (macOS): the attribute is absent.
    monkeypatch.delattr(os, "O_DIRECT", raising=False)
    state = _state()
    assert not save_uncached(state, tmp_path / "optimizer.pt")
    assert (tmp_path / "optimizer.pt").read_bytes() == _saved_bytes(state)
