"""Checkpoints: exact round trip (tied weights included), atomic writes, retention."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from services.learner.checkpoint import CheckpointError, CheckpointManager, write_json_atomic
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
