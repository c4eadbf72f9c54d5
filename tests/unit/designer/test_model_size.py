"""The structured-output default: the policy's size read exactly from its safetensors headers."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from services.designer.model_size import decide_structured_output, parameter_count


def write_safetensors(path: Path, shapes: dict[str, list[int]]) -> None:
    """A safetensors file's header (8-byte length, JSON table); the data is never read."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes.items():
        size = 2
        for d in shape:
            size *= d
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 16)


def test_parameters_are_summed_over_every_shard(tmp_path: Path) -> None:
    write_safetensors(tmp_path / "model-00001-of-00002.safetensors", {"a": [1000, 1000], "b": [10]})
    write_safetensors(tmp_path / "model-00002-of-00002.safetensors", {"c": [3, 4, 5]})
    assert parameter_count(tmp_path) == 1_000_000 + 10 + 60


def test_the_default_is_on_for_small_models_off_for_large_and_unknown(tmp_path: Path) -> None:
    small, large, empty = tmp_path / "small", tmp_path / "large", tmp_path / "tokenizer-only"
    for d in (small, large, empty):
        d.mkdir()
    write_safetensors(small / "model.safetensors", {"w": [1000, 1000]})
    write_safetensors(large / "model.safetensors", {"w": [100_000, 100_000]})
    assert decide_structured_output(None, small, 2_000_000_000).enabled
    decision = decide_structured_output(None, large, 2_000_000_000)
    assert not decision.enabled and "over small_model_params" in decision.reason
    unknown = decide_structured_output(None, empty, 2_000_000_000)
    assert not unknown.enabled and "SPADE_DESIGNER_STRUCTURED_OUTPUT" in unknown.reason
    assert decide_structured_output(True, empty, 0).enabled  # configured wins
    (empty / "broken.safetensors").write_bytes(b"\xff" * 8)
    assert parameter_count(empty) is None


@pytest.mark.model
def test_the_default_model_counts_as_small() -> None:
    from spade.inference.models import ensure_default_model

    count = parameter_count(ensure_default_model())
    assert count is not None and 100_000_000 < count < 200_000_000  # SmolLM2-135M
