"""Learner settings and the ``spade serve learner`` command's refusals."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from pydantic import ValidationError

from services.learner.cli import serve
from services.learner.core.losses import CispoLossConfig, GrpoLossConfig
from services.learner.settings import SPEC_FIELDS, LearnerSettings, SpecContradiction
from spade.cli import main
from spade.runspec import RewardConstants, RunSpec


def test_defaults_are_the_papers(tmp_path):
    s = LearnerSettings(model_path=tmp_path)
    assert isinstance(s.loss, GrpoLossConfig)
    assert (s.loss.eps_low, s.loss.eps_high, s.loss.tis_cap, s.loss.kl_coef) == (0.2, 0.28, 2.0, 0.0)
    assert (s.lr, s.weight_decay, s.beta1, s.beta2) == (1e-6, 0.1, 0.9, 0.98)
    assert s.resource_fault_policy == "drop"
    # What the run spec decides is unset: the spec's values are taken, and never contradicted.
    assert all(v is None for v in s.spec_values().values())
    s.check_spec(RunSpec())


def test_spec_fields_are_the_run_specs_own_names():
    assert set(SPEC_FIELDS) <= set(RunSpec.model_fields)
    values = LearnerSettings(dev_mode=True).spec_values()
    assert {k.split(".")[1] for k in values if k.startswith("rewards.")} <= set(RewardConstants.model_fields)


def test_a_contradicting_setting_is_refused_naming_the_field_and_variable():
    spec = RunSpec(group_size=8, temperature=0.6)
    LearnerSettings(dev_mode=True, group_size=8, temperature=0.6).check_spec(spec)  # agreeing is fine
    with pytest.raises(SpecContradiction) as err:
        LearnerSettings(dev_mode=True, group_size=4, rewards={"regret_scale": 0.3}).check_spec(spec)
    lines = str(err.value).splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("group_size: this service is configured with 4 but the run spec has 8")
    assert "SPADE_LEARNER_GROUP_SIZE" in lines[0]
    assert "rewards.regret_scale" in lines[1] and "SPADE_LEARNER_REWARDS__REGRET_SCALE" in lines[1]


def test_environment_selects_the_loss_variant_and_nested_values(monkeypatch, tmp_path):
    monkeypatch.setenv("SPADE_LEARNER_MODEL_PATH", str(tmp_path))
    monkeypatch.setenv("SPADE_LEARNER_LOSS__TYPE", "cispo")
    monkeypatch.setenv("SPADE_LEARNER_LOSS__KL_COEF", "0.005")
    monkeypatch.setenv("SPADE_LEARNER_REWARDS__VALIDITY_SHAPING_WEIGHT", "0.1")
    monkeypatch.setenv("SPADE_LEARNER_RESOURCE_FAULT_POLICY", "zero")
    s = LearnerSettings()
    assert isinstance(s.loss, CispoLossConfig) and s.loss.kl_coef == 0.005
    assert s.rewards.validity_shaping_weight == 0.1 and s.resource_fault_policy == "zero"


def test_bad_settings_are_refused_with_the_fix():
    with pytest.raises(ValidationError, match="SPADE_LEARNER_MODEL_PATH"):
        LearnerSettings()
    with pytest.raises(ValidationError, match="min_agent_groups"):
        LearnerSettings(dev_mode=True, min_agent_groups=5, agent_groups_per_step=2)
    with pytest.raises(ValidationError, match="resource_fault_policy"):
        LearnerSettings.model_validate({"dev_mode": True, "resource_fault_policy": "keep"})
    with pytest.raises(ValidationError):
        LearnerSettings.model_validate({"dev_mode": True, "loss": {"type": "grpo", "eps_low": 1.5}})


def test_cli_refuses_a_standalone_learner_on_the_in_process_queue(monkeypatch, tmp_path):
    monkeypatch.setenv("SPADE_LEARNER_MODEL_PATH", str(tmp_path))
    monkeypatch.setenv("SPADE_LEARNER_QUEUE__KIND", "inprocess")
    result = CliRunner().invoke(serve, [])
    assert result.exit_code == 2 and "QUEUE__KIND=redis" in result.output
    monkeypatch.delenv("SPADE_LEARNER_MODEL_PATH")
    result = CliRunner().invoke(serve, [])
    assert result.exit_code == 2 and "model_path is required" in result.output


def test_spade_serve_learner_is_wired():
    result = CliRunner().invoke(main, ["serve", "learner", "--help"])
    assert result.exit_code == 0 and "GRPO" in result.output
