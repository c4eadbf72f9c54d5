from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from services.rollout.settings import PoolSandbox, RolloutSettings, SqlMemory
from services.rollout.wiring import worker_config
from spade.config import ConfigError
from spade.endpoints import SandboxEndpoint


def test_an_unauthenticated_sandbox_is_refused_outside_dev_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValidationError, match="SPADE_ROLLOUT_SANDBOX__API_KEY"):
        RolloutSettings()
    monkeypatch.setenv("SPADE_ROLLOUT_SANDBOX__API_KEY", "s3cr3t-rollout-key")
    settings = RolloutSettings()
    assert isinstance(settings.sandbox, SandboxEndpoint) and settings.sandbox.api_key is not None
    assert "s3cr3t-rollout-key" not in repr(settings)  # the key never shows in logs


def test_bounds_and_budgets_are_checked() -> None:
    with pytest.raises(ValidationError, match="group_size"):
        RolloutSettings(dev_mode=True, group_size=0)
    with pytest.raises(ValidationError, match="must be below max_total_tokens"):
        RolloutSettings(dev_mode=True, max_tokens_per_turn=512, max_total_tokens=512)
    with pytest.raises(ValidationError):
        RolloutSettings.model_validate({"dev_mode": True, "sandbox": {"kind": "docker"}})


def test_a_config_file_selects_the_embedded_variants(tmp_path: Path) -> None:
    path = tmp_path / "rollout.yaml"
    path.write_text(
        "dev_mode: true\ngroup_size: 4\nwindow_versions: 2\nqueue: {kind: inprocess}\n"
        "sandbox: {kind: pool}\nmemory: {kind: sql, url: 'sqlite:///m.db'}\nconsumer_name: w7\n"
    )
    settings = RolloutSettings.load(path)
    assert isinstance(settings.sandbox, PoolSandbox) and isinstance(settings.memory, SqlMemory)
    assert settings.queue.kind == "inprocess"
    config = worker_config(settings)
    assert (config.group_size, config.window, config.consumer) == (4, 2, "w7")
    assert settings.play_limits().max_turns == settings.max_turns
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        RolloutSettings.load(bad)


def test_one_variable_sets_one_nested_value_and_the_rest_keep_their_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPADE_ROLLOUT_SANDBOX__TARGET", "sandbox:50051")
    monkeypatch.setenv("SPADE_ROLLOUT_SANDBOX__API_KEY", "k")
    monkeypatch.setenv("SPADE_ROLLOUT_QUEUE__URL", "redis://redis:6379/0")
    monkeypatch.setenv("SPADE_ROLLOUT_RETRY__ATTEMPTS", "2")
    settings = RolloutSettings()
    assert isinstance(settings.sandbox, SandboxEndpoint) and settings.sandbox.target == "sandbox:50051"
    assert settings.sandbox.open_timeout_s == SandboxEndpoint().open_timeout_s
    assert settings.queue.kind == "redis" and settings.queue.url == "redis://redis:6379/0"
    assert worker_config(settings).play_retry.attempts == 2
