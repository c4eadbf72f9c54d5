"""Publishing weights and reloading them: the files the learner writes, and the server's fast load.

``write_weights`` writes safetensors straight from the model's tensors; the result must be what
``save_pretrained`` writes (names, values, config). The inference server's weight update maps those
files into a skeleton of the served model (``load_model(..., like=served)``); the result must equal a
``from_pretrained`` load, and a checkpoint of another configuration must still be loaded in full.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from services.learner.checkpoint import TOKENIZER_FILES, full_model_state, write_weights
from spade.inference import models
from spade.inference.models import load_model

_PROVENANCE = {"_name_or_path", "transformers_version"}


def _changed(base: Path, delta: float = 0.01) -> Any:
    model = AutoModelForCausalLM.from_pretrained(str(base))
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.add_(delta * (i + 1))
    return model


def _config(path: Path) -> dict[str, Any]:
    return {k: v for k, v in json.loads((path / "config.json").read_text()).items() if k not in _PROVENANCE}


def test_written_weights_are_what_save_pretrained_writes(tmp_path, base_model):
    model = _changed(base_model)
    ours = tmp_path / "weights" / "v1"
    assert write_weights(model, ours, base_model_dir=base_model) == ours
    reference = tmp_path / "reference"
    model.save_pretrained(reference)

    a, b = load_file(str(ours / "model.safetensors")), load_file(str(reference / "model.safetensors"))
    assert a.keys() == b.keys() and "lm_head.weight" not in a  # the tied head is stored once
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert _config(ours) == _config(reference)
    assert (ours / "generation_config.json").is_file() == (reference / "generation_config.json").is_file()
    # Tokenizer files are linked from the base checkpoint, not copied (the generation config is the model's).
    linked = [n for n in TOKENIZER_FILES if (base_model / n).is_file() and n != "generation_config.json"]
    assert linked and all((ours / n).stat().st_ino == (base_model / n).stat().st_ino for n in linked)
    assert [p.name for p in ours.parent.iterdir()] == ["v1"]  # no staging directory left


def test_the_state_of_an_unsharded_model_is_its_own_tensors(base_model):
    model = AutoModelForCausalLM.from_pretrained(str(base_model))
    state = full_model_state(model)
    live = model.state_dict()
    assert state.keys() == live.keys()
    assert all(state[k].data_ptr() == live[k].data_ptr() for k in state)  # no copy
    assert not any(t.requires_grad for t in state.values())


def test_a_weight_update_maps_the_files_into_the_served_architecture(tmp_path, base_model, monkeypatch):
    served = load_model(base_model)
    path = write_weights(_changed(base_model), tmp_path / "v1", base_model_dir=base_model)
    assert path is not None
    reference = load_model(path)

    def no_full_load(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a same-configuration update must not go through from_pretrained")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_full_load)
    fast: Any = load_model(path, like=served)
    assert not fast.training and fast.config._attn_implementation == served.config._attn_implementation
    ref_state, fast_state = reference.state_dict(), fast.state_dict()
    assert fast_state.keys() == ref_state.keys()
    for name, tensor in ref_state.items():
        assert not fast_state[name].is_meta, name
        assert torch.equal(fast_state[name], tensor), name
    assert fast.lm_head.weight.data_ptr() == fast.model.embed_tokens.weight.data_ptr()  # still tied
    ids = torch.randint(0, served.config.vocab_size, (2, 9))
    with torch.no_grad():
        assert torch.equal(fast(input_ids=ids).logits, reference(input_ids=ids).logits)
        assert not torch.equal(fast(input_ids=ids).logits, served(input_ids=ids).logits)


def test_a_checkpoint_of_another_configuration_is_loaded_in_full(tmp_path, base_model):
    served = load_model(base_model)
    other = _changed(base_model)
    other.config.rms_norm_eps = 0.5  # a different model, same tensor shapes
    path = write_weights(other, tmp_path / "v1", base_model_dir=base_model)
    assert path is not None
    loaded = load_model(path, like=served)
    assert loaded.config.rms_norm_eps == 0.5


def test_a_checkpoint_whose_tensors_do_not_fit_falls_back(tmp_path, base_model):
    served = load_model(base_model)
    path = write_weights(_changed(base_model), tmp_path / "v1", base_model_dir=base_model)
    assert path is not None
    from safetensors.torch import save_file

    weights = load_file(str(path / "model.safetensors"))
    weights["model.extra.weight"] = torch.zeros(2)
    save_file(weights, str(path / "model.safetensors"), {"format": "pt"})
    assert models._load_like(path, torch.float32, served) is None
    loaded = load_model(path, like=served)  # from_pretrained, which ignores the stray tensor
    assert torch.equal(loaded.model.norm.weight, weights["model.norm.weight"])


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_a_server_in_another_dtype_gets_converted_weights(tmp_path, base_model, dtype):
    served = load_model(base_model, dtype)
    path = write_weights(_changed(base_model), tmp_path / "v1", base_model_dir=base_model)
    assert path is not None
    fast = load_model(path, dtype, like=served)
    assert {p.dtype for p in fast.parameters()} == {dtype}
    assert torch.equal(fast.model.norm.weight, load_model(path, dtype).model.norm.weight)
