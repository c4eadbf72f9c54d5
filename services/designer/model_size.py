"""How big the policy is, for the structured-output default: counted from the checkpoint's safetensors.

``DesignerSettings.structured_output`` unset means "on for small models": a 135M model wrote 12 of
12 answers malformed without the answer format enforced, so no check ever reached its code, while a
model of several billion parameters follows the format by itself and may want to think before the
code (which the grammar would forbid). The parameter count is read exactly from the safetensors
headers (8-byte length, then a JSON table of tensor shapes); no weights are loaded.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from spade.serving.logs import get_logger

log = get_logger(__name__)

_MAX_HEADER_BYTES = 100 * 1024 * 1024


def parameter_count(checkpoint: Path) -> int | None:
    """Parameters of the model in ``checkpoint`` (every ``*.safetensors`` file), ``None`` when unknown.

    Unknown: no safetensors file (e.g. a tokenizer-only directory) or a header that cannot be read.
    """
    files = sorted(checkpoint.glob("*.safetensors")) if checkpoint.is_dir() else []
    if not files:
        return None
    total = 0
    for path in files:
        try:
            with path.open("rb") as fh:
                (length,) = struct.unpack("<Q", fh.read(8))
                if length > _MAX_HEADER_BYTES:
                    return None
                header = json.loads(fh.read(length))
        except (OSError, struct.error, ValueError):
            return None
        for name, info in header.items():
            if name != "__metadata__":
                total += math.prod(int(d) for d in info["shape"])
    return total


@dataclass(frozen=True)
class StructuredDecision:
    """Whether answers are constrained to the answer format, and why (logged at start)."""

    enabled: bool
    reason: str


def decide_structured_output(configured: bool | None, checkpoint: Path, max_params: int) -> StructuredDecision:
    """The structured-output decision: ``configured`` when set, else by the policy's size."""
    if configured is not None:
        return StructuredDecision(configured, f"structured_output={str(configured).lower()} is configured")
    count = parameter_count(checkpoint)
    if count is None:
        return StructuredDecision(
            False,
            f"the policy's size is unknown (no safetensors in {checkpoint}): answers are not constrained; "
            "set SPADE_DESIGNER_STRUCTURED_OUTPUT to decide",
        )
    small = count <= max_params
    return StructuredDecision(
        small,
        f"the policy has {count / 1e6:.1f}M parameters, {'at most' if small else 'over'} "
        f"small_model_params={max_params / 1e6:.0f}M",
    )
