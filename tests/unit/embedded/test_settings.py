"""``spade run``'s settings: one ServiceSettings, typed per-service overrides checked when they are built."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from pydantic import ValidationError

from services.embedded.cli import run as run_command
from services.embedded.departures import departures
from services.embedded.roles import CPU_MICRO_BATCH_TOKENS, role_settings, run_spec
from services.embedded.settings import RunSettings, ServiceOverrides
from services.sandbox.isolation.settings import IsolationSettings
from spade.config import describe_error
from spade.envs import CheckConfig
from spade.queues.config import InProcessQueueConfig
from spade.runspec import RunSpec

SECTIONS = ("designer", "rollout", "learner", "inference")


def _fails(**values: object) -> str:
    with pytest.raises(ValidationError) as caught:
        RunSettings(**values)  # type: ignore[arg-type]
    return describe_error(caught.value, RunSettings)


@pytest.mark.parametrize("section", SECTIONS)
def test_an_unknown_field_of_a_service_is_refused_naming_it(section: str) -> None:
    message = _fails(**{section: {"max_new_tokenz": 64}})
    assert f"SPADE_RUN_{section.upper()}__MAX_NEW_TOKENZ" in message and "not permitted" in message


def test_override_values_are_checked_against_the_service_s_own_field() -> None:
    assert "SPADE_RUN_DESIGNER__MAX_NEW_TOKENS" in _fails(designer={"max_new_tokens": 0})
    assert "SPADE_RUN_ROLLOUT__GROUP_SIZE" in _fails(rollout={"group_size": "many"})
    assert "SPADE_RUN_LEARNER__QUEUE" in _fails(learner={"queue": {"kind": "carrier-pigeon"}})
    assert "SPADE_RUN_ISOLATION__NOPE" in _fails(isolation={"nope": 1})
    assert "seed_count must be an int in [2, 64]" in _fails(checks={"seed_count": 1})


def test_overrides_are_typed_and_keep_only_what_was_set() -> None:
    settings = RunSettings(
        designer={"max_new_tokens": 64},
        rollout={"queue": {"kind": "inprocess"}},
        isolation={"wall_seconds": 5.0},
        checks={"seed_count": 3},
    )
    assert isinstance(settings.designer, ServiceOverrides)
    assert settings.designer.values() == {"max_new_tokens": 64}
    assert isinstance(settings.rollout.values()["queue"], InProcessQueueConfig)
    assert settings.learner.values() == {} and settings.inference.values() == {}
    assert isinstance(settings.isolation, IsolationSettings) and settings.isolation.wall_seconds == 5.0
    assert isinstance(settings.checks, CheckConfig) and settings.checks.seed_count == 3
    dumped = json.loads(settings.model_dump_json())
    assert dumped["designer"] == {"max_new_tokens": 64} and dumped["learner"] == {}


def test_every_section_field_keeps_the_service_s_description() -> None:
    schema = RunSettings.model_json_schema()
    for name in ("DesignerOverrides", "RolloutOverrides", "LearnerOverrides", "InferenceOverrides"):
        properties = schema["$defs"][name]["properties"]
        missing = [field for field, spec in properties.items() if not spec.get("description")]
        assert properties and not missing, f"{name}: {missing}"
    assert all(spec.get("description") for spec in schema["properties"].values())


def test_file_then_environment_then_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "run.yaml"
    config.write_text("steps: 7\ngroup_size: 6\ndesigner:\n  max_new_tokens: 96\n")
    monkeypatch.setenv("SPADE_RUN_GROUP_SIZE", "5")
    monkeypatch.setenv("SPADE_RUN_ROLLOUT__MAX_CONCURRENT_PLAYS", "3")
    settings = RunSettings.load(config, steps=9, setting=None)
    assert (settings.steps, settings.group_size, settings.setting) == (9, 6, "game")
    assert settings.designer.values() == {"max_new_tokens": 96}
    assert settings.rollout.values() == {"max_concurrent_plays": 3}


def test_each_role_gets_the_run_s_values_then_its_overrides(tmp_path: Path) -> None:
    settings = RunSettings(
        run_dir=tmp_path,
        group_size=6,
        temperature=0.9,
        designer={"max_new_tokens": 96},
        rollout={"block_ms": 10},
        learner={"lr": 3e-4},
    )
    roles = role_settings(settings, inference_url="http://127.0.0.1:1", model=tmp_path / "model")
    assert roles.designer.max_new_tokens == 96
    assert (roles.rollout.block_ms, roles.rollout.state_url) == (10, f"sqlite:///{tmp_path / 'rollout.db'}")
    assert (roles.learner.lr, roles.learner.checkpoint_dir) == (3e-4, tmp_path / "checkpoints")
    urls = ["http://127.0.0.1:1"]
    assert roles.designer.inference_urls == roles.rollout.inference_urls == roles.learner.inference_urls == urls
    spec = run_spec(settings)  # what every role agrees on comes from the run's own knobs
    assert (spec.temperature, spec.group_size, spec.designer_max_new_tokens) == (0.9, 6, 640)


def test_the_cpu_learner_trains_in_small_micro_batches_unless_told_otherwise(tmp_path: Path) -> None:
    # One 8192-token pass of the 135M model peaked at 20.9 GB on CPU: a default run was OOM-killed.
    roles = role_settings(RunSettings(run_dir=tmp_path), inference_url="http://127.0.0.1:1", model=tmp_path / "m")
    assert roles.learner.micro_batch_tokens == CPU_MICRO_BATCH_TOKENS <= 2048
    told = RunSettings(run_dir=tmp_path, learner={"micro_batch_tokens": 4096})
    assert (
        role_settings(told, inference_url="http://127.0.0.1:1", model=tmp_path / "m").learner.micro_batch_tokens == 4096
    )


def test_the_cpu_learner_trains_in_bf16_where_the_cpu_has_it_unless_told_otherwise(tmp_path: Path) -> None:
    from spade.cpu_linear import native_bf16

    roles = role_settings(RunSettings(run_dir=tmp_path), inference_url="http://127.0.0.1:1", model=tmp_path / "m")
    assert roles.learner.cpu_bf16 is native_bf16()
    for told in (False, True):
        settings = RunSettings(run_dir=tmp_path, learner={"cpu_bf16": told})
        learner = role_settings(settings, inference_url="http://127.0.0.1:1", model=tmp_path / "m").learner
        assert learner.cpu_bf16 is told


def test_a_rule_across_a_service_s_fields_is_checked_when_its_settings_are_built(tmp_path: Path) -> None:
    settings = RunSettings(run_dir=tmp_path, designer={"doc_min_words": 700})  # above the default 600 words
    with pytest.raises(ValidationError, match="doc_min_words"):
        role_settings(settings, inference_url="http://127.0.0.1:1", model=tmp_path / "model")


def test_the_run_s_own_rules_name_the_fields_and_the_fix(tmp_path: Path) -> None:
    assert "skills_per_round=3 exceeds envs_per_step=2" in _fails(skills_per_round=3)
    message = _fails(designer_mode="off", designer_pool=tmp_path)
    assert "designer_pool" in message and "designer_mode=off" in message
    assert "nothing to play" in _fails(designer_mode="off", seed_pool=False)
    assert "SPADE_RUN_PRESET" in _fails(preset="paper-chess")


def test_designer_modes_and_ablations_reach_the_designer_s_settings(tmp_path: Path) -> None:
    def designer(**values: object) -> object:
        settings = RunSettings(run_dir=tmp_path, **values)  # type: ignore[arg-type]
        return role_settings(settings, inference_url="http://127.0.0.1:1", model=tmp_path).designer

    plain = designer()
    assert not plain.frozen and plain.doc_max_words > 0 and plain.n_positive > 0  # type: ignore[attr-defined]
    assert designer(designer_mode="frozen").frozen  # type: ignore[attr-defined]
    assert designer(corpus=False).doc_max_words == 0  # type: ignore[attr-defined]
    no_memory = designer(memory_examples=False)
    assert (no_memory.n_positive, no_memory.n_negative) == (0, 0)  # type: ignore[attr-defined]
    assert designer(regenerate_every=3).regenerate_every == 3  # type: ignore[attr-defined]


def test_the_spec_takes_the_run_s_rounds_and_only_its_own_setting_s_window(tmp_path: Path) -> None:
    spec = run_spec(
        RunSettings(run_dir=tmp_path, setting="tool", window_versions=2, envs_per_step=6, skills_per_round=3)
    )
    assert (spec.window_versions_tool, spec.envs_per_round, spec.skills_per_round) == (2, 6, 3)
    assert spec.window_versions_game == RunSpec().window_versions_game


def test_spade_run_refuses_bad_settings_in_one_line_per_problem_before_starting(tmp_path: Path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text("steps: 0\nrollout:\n  nope: 1\n")
    result = CliRunner().invoke(run_command, ["--config", str(config), "--run-dir", str(tmp_path / "run")])
    assert result.exit_code == 2, result.output
    assert "SPADE_RUN_STEPS" in result.output and "SPADE_RUN_ROLLOUT__NOPE" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "run").exists()

    config.write_text("- a list\n")
    result = CliRunner().invoke(run_command, ["--config", str(config)])
    assert result.exit_code == 2 and "expected a mapping of settings" in result.output


def test_the_embedded_designer_generates_a_slot_s_attempts_together_in_one_batch(tmp_path: Path) -> None:
    def designer(**values: Any) -> Any:
        settings = RunSettings(run_dir=tmp_path, **values)
        return role_settings(settings, inference_url="http://127.0.0.1:1", model=tmp_path).designer

    default = designer()
    assert default.attempts_at_once == default.max_attempts_per_env == 2
    assert default.concurrency == 2 * 2  # every slot's attempts: one batch on the server
    told = designer(envs_per_step=3, designer_attempts=4, designer={"attempts_at_once": 1})
    assert (told.max_attempts_per_env, told.attempts_at_once, told.concurrency) == (4, 1, 3)
    assert any(
        line.startswith("designer.attempts_at_once = 2 (paper: 1") for line in departures(RunSettings(run_dir=tmp_path))
    )
