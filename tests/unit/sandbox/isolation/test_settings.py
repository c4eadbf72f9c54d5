"""Isolation settings: bounds, degraded layers, defaults within maxima."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.sandbox.isolation import IsolationSettings


def test_defaults_require_every_layer_and_a_non_root_uid() -> None:
    settings = IsolationSettings()
    assert settings.allow_degraded == []
    assert settings.uid != 0 and settings.gid != 0


@pytest.mark.parametrize("field", ["uid", "gid"])
def test_root_is_refused(field: str) -> None:
    with pytest.raises(ValidationError):
        IsolationSettings.model_validate({field: 0})


def test_python_cannot_be_degraded() -> None:
    with pytest.raises(ValidationError, match="cannot contain 'python'"):
        IsolationSettings(allow_degraded=["python"])


def test_unknown_layer_is_refused() -> None:
    with pytest.raises(ValidationError):
        IsolationSettings.model_validate({"allow_degraded": ["firewall"]})


def test_default_above_maximum_names_both() -> None:
    with pytest.raises(ValidationError, match="memory_mb=4096 exceeds max_memory_mb=2048"):
        IsolationSettings(memory_mb=4096)


def test_every_field_is_documented() -> None:
    for name, field in IsolationSettings.model_fields.items():
        assert field.description, name
