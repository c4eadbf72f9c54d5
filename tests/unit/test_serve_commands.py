"""Every ``spade serve X`` configures and fails the same way (issue 9): one settings base, one refusal.

- every service's settings derive from ``spade.config.ServiceSettings`` and document every field,
  nested sections included;
- every ``spade serve X`` takes ``--config FILE``, and a bad value prints one line naming the
  environment variable and exits with status 2 — no traceback;
- outside dev mode, unsafe defaults are refused when the settings are built (no opt-in check).
"""

from __future__ import annotations

import typing
from typing import Any

import pytest
from click.testing import CliRunner
from pydantic import BaseModel

from spade.cli import main, serve
from spade.config import ServiceSettings

SERVICES = sorted(serve.list_commands(None))  # type: ignore[arg-type]


def settings_class(service: str) -> type[ServiceSettings]:
    from services.designer.settings import DesignerSettings
    from services.inference.settings import InferenceSettings
    from services.learner.settings import LearnerSettings
    from services.memory.settings import MemorySettings
    from services.rollout.settings import RolloutSettings
    from services.sandbox.settings import SandboxSettings

    classes: dict[str, type[ServiceSettings]] = {
        "designer": DesignerSettings,
        "inference": InferenceSettings,
        "learner": LearnerSettings,
        "memory": MemorySettings,
        "rollout": RolloutSettings,
        "sandbox": SandboxSettings,
    }
    return classes[service]


def _models(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models inside a field's annotation (unions, lists, Annotated)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models(arg)]


def undocumented(model: type[BaseModel], prefix: str = "", seen: set[type] | None = None) -> list[str]:
    seen = seen if seen is not None else set()
    if model in seen:
        return []
    seen.add(model)
    missing = []
    for name, field in model.model_fields.items():
        if name in ("kind", "type") and typing.get_origin(field.annotation) is typing.Literal:
            continue  # a variant's tag: its meaning is the variant's docstring
        if not (field.description or "").strip():
            missing.append(prefix + name)
        for sub in _models(field.annotation):
            missing += undocumented(sub, f"{prefix}{name}.", seen)
    return missing


def test_the_serve_commands_are_the_six_services() -> None:
    assert SERVICES == ["designer", "inference", "learner", "memory", "rollout", "sandbox"]


@pytest.mark.parametrize("service", SERVICES)
def test_settings_derive_from_the_one_base_and_document_every_field(service: str) -> None:
    cls = settings_class(service)
    assert issubclass(cls, ServiceSettings) and cls.service_name == service
    assert cls.model_config.get("env_prefix") == f"SPADE_{service.upper()}_"
    assert undocumented(cls) == []
    assert not hasattr(cls, "require_safe") and not hasattr(cls, "check_safe") and not hasattr(cls, "load_settings")


@pytest.mark.parametrize("service", SERVICES)
def test_a_bad_value_names_its_variable_and_exits_2(service: str, monkeypatch: pytest.MonkeyPatch) -> None:
    variable = settings_class(service).env_name("dev_mode")
    monkeypatch.setenv(variable, "perhaps")
    result = CliRunner().invoke(main, ["serve", service])
    assert result.exit_code == 2, result.output
    assert variable in result.output and "Traceback" not in result.output
    assert "--config" in CliRunner().invoke(main, ["serve", service, "--help"]).output


@pytest.mark.parametrize("service", ["designer", "memory", "rollout", "sandbox"])
def test_unsafe_defaults_are_refused_when_built_and_allowed_in_dev_mode(service: str) -> None:
    cls = settings_class(service)
    with pytest.raises(ValueError, match="unsafe settings outside dev mode"):
        cls()
    assert cls(dev_mode=True).dev_mode


@pytest.mark.parametrize("service", SERVICES)
def test_log_level_sets_the_level_of_every_serve_command(service: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import logging

    from spade.serving import logs

    monkeypatch.setenv(settings_class(service).env_name("dev_mode"), "perhaps")  # stop right after logging is set
    monkeypatch.setenv("SPADE_LOG_LEVEL", "WARNING")
    root = logging.getLogger()
    before = root.level
    try:
        result = CliRunner().invoke(main, ["serve", service, "--log-level", "debug"])
        assert result.exit_code == 2, result.output
        assert root.level == logging.DEBUG  # the flag wins over SPADE_LOG_LEVEL (it was a no-op before)
        result = CliRunner().invoke(main, ["serve", service, "--log-level", "loud"])
        assert result.exit_code == 2 and "'loud' is not one of DEBUG, INFO" in result.output, result.output
    finally:
        logs.reset()
        root.setLevel(before)
