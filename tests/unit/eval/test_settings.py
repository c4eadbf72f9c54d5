"""spade eval's settings: documented, bounded, suite defaults, unsafe sandboxes refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from services.eval.settings import SUITE_SAMPLING, EvalSettings
from spade.config import describe_error

OURS = ("ReasoningGymSettings", "BfclSettings", "PoolSettings")  # nested sections of other packages test their own


def _fields(schema: dict[str, Any]) -> dict[str, dict[str, Any]]:
    found = {f"EvalSettings.{k}": v for k, v in schema["properties"].items()}
    for name in OURS:
        found.update({f"{name}.{k}": v for k, v in schema["$defs"][name]["properties"].items()})
    return found


def test_every_field_has_a_description() -> None:
    fields = _fields(EvalSettings.model_json_schema())
    missing = [name for name, spec in fields.items() if not spec.get("description")]
    assert "EvalSettings.concurrency" in fields and "PoolSettings.seeds_per_env" in fields
    assert not missing, missing


def test_suite_defaults_and_overrides() -> None:
    settings = EvalSettings()
    assert settings.sampling_for("bfcl-multi-turn") == (0.0, 512)
    assert settings.sampling_for("reasoning-gym") == SUITE_SAMPLING["reasoning-gym"]
    assert settings.sampling_for("pool") == (0.6, settings.pool.max_tokens_per_turn)
    custom = EvalSettings(temperature=0.2, max_new_tokens=64)
    assert custom.sampling_for("bfcl-multi-turn") == (0.2, 64)


def test_environment_and_file_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "eval.yaml"
    config.write_text("concurrency: 3\nreasoning_gym:\n  items_per_category: 5\n")
    monkeypatch.setenv("SPADE_EVAL_POOL__SEEDS_PER_ENV", "9")
    settings = EvalSettings.load(config)
    assert (settings.concurrency, settings.reasoning_gym.items_per_category, settings.pool.seeds_per_env) == (3, 5, 9)


@pytest.mark.parametrize(
    ("values", "where"),
    [
        ({"concurrency": 0}, "SPADE_EVAL_CONCURRENCY"),
        ({"bfcl": {"categories": ["simple"]}}, "SPADE_EVAL_BFCL__CATEGORIES"),
        ({"reasoning_gym": {"datasets": ["gcd", "gcd"]}}, "twice"),
        ({"pool": {"seeds_per_env": 0}}, "SPADE_EVAL_POOL__SEEDS_PER_ENV"),
    ],
)
def test_bad_values_are_named(values: dict[str, Any], where: str) -> None:
    with pytest.raises(ValidationError) as info:
        EvalSettings(**values)
    assert where in describe_error(info.value, EvalSettings)


def test_a_degraded_sandbox_or_a_keyless_service_is_refused_outside_dev_mode() -> None:
    degraded = {"sandbox": {"kind": "pool", "isolation": {"allow_degraded": ["userns"]}}}
    with pytest.raises(ValidationError, match="degraded isolation"):
        EvalSettings(pool=degraded)
    assert EvalSettings(pool=degraded, dev_mode=True).pool.sandbox.kind == "pool"
    with pytest.raises(ValidationError, match="SPADE_EVAL_POOL__SANDBOX__API_KEY"):
        EvalSettings(pool={"sandbox": {"kind": "grpc", "target": "sandbox:50051"}})
