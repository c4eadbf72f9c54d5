from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from services.rollout.settings import SPEC_FIELDS, RolloutSettings, SpecContradiction, SqlMemory
from services.rollout.wiring import worker_config
from spade.config import ConfigError
from spade.endpoints import PoolSandbox, SandboxEndpoint
from spade.runspec import RunSpec


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
    with pytest.raises(ValidationError, match="must be below agent_max_total_tokens"):
        RolloutSettings(dev_mode=True, agent_max_tokens_per_turn=512, agent_max_total_tokens=512)
    with pytest.raises(ValidationError):
        RolloutSettings.model_validate({"dev_mode": True, "sandbox": {"kind": "docker"}})


def test_a_config_file_selects_the_embedded_variants(tmp_path: Path) -> None:
    path = tmp_path / "rollout.yaml"
    path.write_text(
        "dev_mode: true\ngroup_size: 4\nwindow_versions_game: 2\nqueue: {kind: inprocess}\n"
        "sandbox: {kind: pool}\nmemory: {kind: sql, url: 'sqlite:///m.db'}\nconsumer_name: w7\n"
    )
    settings = RolloutSettings.load(path)
    assert isinstance(settings.sandbox, PoolSandbox) and isinstance(settings.memory, SqlMemory)
    assert settings.queue.kind == "inprocess"
    spec = RunSpec(group_size=4, window_versions_game=2)
    config = worker_config(settings, spec)
    assert (config.spec.group_size, config.spec.window_for("game"), config.consumer) == (4, 2, "w7")
    assert settings.play_limits(spec).max_turns == spec.agent_max_turns
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
    assert worker_config(settings, RunSpec()).play_retry.attempts == 2


def test_the_run_specs_fields_are_taken_from_the_spec_unless_set() -> None:
    settings = RolloutSettings(dev_mode=True)
    assert all(getattr(settings, name) is None for name in SPEC_FIELDS)
    assert set(SPEC_FIELDS) <= set(RunSpec.model_fields)  # one name per concept
    spec = RunSpec(group_size=8, agent_max_turns=12, temperature=0.8)
    settings.check_spec(spec)  # nothing set: nothing contradicts
    limits = settings.play_limits(spec)
    assert (limits.max_turns, limits.temperature, limits.max_total_tokens) == (12, 0.8, spec.agent_max_total_tokens)
    RolloutSettings(dev_mode=True, group_size=8, temperature=0.8).check_spec(spec)  # set and equal: fine


def test_a_setting_contradicting_the_run_spec_is_refused_naming_the_field_and_its_variable() -> None:
    spec = RunSpec(group_size=8, agent_max_turns=12)
    settings = RolloutSettings(dev_mode=True, group_size=4, agent_max_turns=12, top_p=0.9)
    with pytest.raises(SpecContradiction) as refused:
        settings.check_spec(spec)
    lines = sorted(str(refused.value).splitlines())
    assert len(lines) == 2
    assert lines[0].startswith("group_size: this service is configured with 4 but the run spec has 8")
    assert "SPADE_ROLLOUT_GROUP_SIZE" in lines[0]
    assert lines[1].startswith("top_p: this service is configured with 0.9 but the run spec has 1.0")


def test_the_default_worker_name_is_stable_across_restarts_not_the_pid() -> None:
    import os

    name = RolloutSettings(dev_mode=True).consumer_name
    assert name == RolloutSettings(dev_mode=True).consumer_name and str(os.getpid()) not in name


async def test_the_wiring_builds_no_in_process_memory_or_sandbox_itself(tmp_path: Path) -> None:
    """A memory database or a sandbox pool is another service's inside: only a composition root opens
    one (services/rollout/standalone.py for `spade serve rollout`), and the wiring says so."""
    from services.rollout.wiring import rollout_worker

    base = {"dev_mode": True, "state_url": f"sqlite:///{tmp_path / 'state.db'}", "queue": {"kind": "inprocess"}}
    spec = RunSpec()
    sql = RolloutSettings.model_validate({**base, "memory": {"kind": "sql", "url": f"sqlite:///{tmp_path / 'm.db'}"}})
    with pytest.raises(TypeError, match=r"memory kind 'sql' runs in this process.*services\.rollout\.standalone"):
        async with rollout_worker(sql, spec=spec):
            pass
    assert not (tmp_path / "m.db").exists()
    pool = RolloutSettings.model_validate({**base, "sandbox": {"kind": "pool"}})
    with pytest.raises(TypeError, match=r"sandbox kind 'pool' runs in this process.*open_sessions="):
        async with rollout_worker(pool, spec=spec, memory=object(), inference=object()):  # type: ignore[arg-type]
            pass
