"""The paper presets: one definition, the files under configs/ equal to it, accepted by each service."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from services.designer.settings import DesignerSettings
from services.embedded.cli import run as run_command
from services.embedded.departures import departures
from services.embedded.presets import PAPER, PRESETS, render_files
from services.embedded.roles import role_settings, run_spec
from services.embedded.settings import RunSettings
from services.learner.settings import LearnerSettings
from services.memory.settings import MemorySettings
from spade.memory.runspec import load_spec_file

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


@pytest.mark.parametrize("name", PRESETS)
def test_the_files_under_configs_are_the_presets(name: str) -> None:
    for relative, text in render_files(name).items():  # type: ignore[arg-type]
        path = CONFIGS / relative
        assert path.exists(), f"{path} missing: run python -m services.embedded.presets configs"
        assert path.read_text() == text, f"{path} differs from services/embedded/presets.py: regenerate it"


@pytest.mark.parametrize("name", PRESETS)
def test_a_preset_run_departs_from_the_paper_in_nothing(name: str, tmp_path: Path) -> None:
    settings = RunSettings(preset=name, run_dir=tmp_path)
    assert departures(settings) == []
    spec = run_spec(settings)
    setting = "game" if name == "paper-game" else "tool"
    assert (spec.group_size, spec.envs_per_round, spec.skills_per_round, spec.agent_max_turns) == (16, 24, 3, 25)
    assert (spec.temperature, spec.window_for(setting), spec.designer_max_new_tokens) == (
        0.6,
        4 if setting == "game" else 8,
        16384,
    )
    roles = role_settings(settings, inference_url="http://127.0.0.1:1", model=tmp_path)
    assert roles.designer.max_attempts_per_env == 5 and roles.designer.regenerate_every == spec.window_for(setting)
    # The reference retries after each failure: one generation per slot in flight, 24 slots at once.
    assert (roles.designer.attempts_at_once, roles.designer.concurrency) == (1, 24)
    assert (roles.learner.lr, roles.learner.weight_decay, roles.learner.beta1, roles.learner.beta2) == (
        1e-6,
        0.1,
        0.9,
        0.98,
    )
    loss = roles.learner.loss
    assert (loss.eps_low, loss.eps_high, loss.tis_cap) == (0.2, 0.28, 2.0)  # type: ignore[union-attr]
    assert loss.kl_coef == (0.005 if setting == "tool" else 0.0)
    assert roles.designer.criteria_reachable.enabled is (setting == "tool")
    assert not settings.seed_pool and settings.validity_shaping == 0.0 and settings.memory_window == 200


def test_the_file_environment_and_flags_go_on_top_of_a_preset(tmp_path: Path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text("preset: paper-tool\nsteps: 2\nlearner:\n  loss:\n    type: grpo\n    kl_coef: 0.01\n")
    settings = RunSettings.load(config, group_size=4)
    assert (settings.setting, settings.steps, settings.group_size, settings.envs_per_step) == ("tool", 2, 4, 24)
    roles = role_settings(settings, inference_url="http://127.0.0.1:1", model=tmp_path)
    assert roles.learner.loss.kl_coef == 0.01 and roles.learner.loss.tis_cap == 2.0  # the rest of the preset stays
    lines = departures(settings)
    assert [line.split(" = ")[0] for line in lines] == ["group_size", "steps", "learner.loss"]
    assert "paper: 16" in lines[0] and "REFERENCE §3" in lines[0]


def test_the_default_run_lists_its_departures_with_a_reason(tmp_path: Path) -> None:
    lines = departures(RunSettings(run_dir=tmp_path))
    named = {line.split(" = ")[0] for line in lines}
    assert {"seed_pool", "validity_shaping", "window_versions", "lr", "steps", "group_size"} <= named
    assert all("(paper: " in line and "): " in line for line in lines)
    assert not any(line.endswith("set for this run") for line in lines), "every default departure says why"


@pytest.mark.parametrize("name", PRESETS)
def test_each_service_accepts_its_file_and_agrees_with_the_spec(name: str) -> None:
    spec = load_spec_file(CONFIGS / name / "runspec.yaml")
    designer = DesignerSettings.load(CONFIGS / name / "designer.yaml", dev_mode=True)
    assert designer.spec_problems(spec) == []
    learner = LearnerSettings.load(CONFIGS / name / "learner.yaml", dev_mode=True)
    assert learner.lr == 1e-6 and learner.weight_decay == 0.1
    memory = MemorySettings.load(CONFIGS / name / "memory.yaml", dev_mode=True)
    assert memory.window == 200 and memory.excerpt_chars == 2000
    embedded = RunSettings.load(CONFIGS / f"{name}.yaml")
    assert run_spec(embedded) == spec  # the embedded file and the distributed files describe one run


def test_every_paper_value_names_its_source() -> None:
    assert all(item.source and ("REFERENCE §" in item.source or "issue" in item.source) for item in PAPER)


def test_help_lists_the_default_departures() -> None:
    result = CliRunner().invoke(run_command, ["--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "departs from the paper" in result.output
    assert "seed_pool = True (paper: False" in result.output and "lr = 1e-05 (paper: 1e-06" in result.output
