"""Learner settings and the ``spade serve learner`` command's refusals."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from pydantic import ValidationError

from services.learner.cli import serve
from services.learner.core.losses import CispoLossConfig, GrpoLossConfig
from services.learner.settings import LearnerSettings
from spade.cli import main


def test_defaults_are_the_papers(tmp_path):
    s = LearnerSettings(model_path=tmp_path)
    assert isinstance(s.loss, GrpoLossConfig)
    assert (s.loss.eps_low, s.loss.eps_high, s.loss.tis_cap, s.loss.kl_coef) == (0.2, 0.28, 2.0, 0.0)
    assert (s.lr, s.weight_decay, s.beta1, s.beta2) == (1e-6, 0.1, 0.9, 0.98)
    cfg = s.rewards.to_config()
    assert (cfg.regret_weight, cfg.plateau_weight, cfg.regret_scale, cfg.validity_shaping_weight) == (0.4, 0.6, 0.15, 0)
    assert (cfg.band.zero_low, cfg.band.low, cfg.band.high, cfg.band.zero_high) == (0.15, 0.4, 0.6, 0.85)


def test_environment_selects_the_loss_variant_and_nested_values(monkeypatch, tmp_path):
    monkeypatch.setenv("SPADE_LEARNER_MODEL_PATH", str(tmp_path))
    monkeypatch.setenv("SPADE_LEARNER_LOSS__TYPE", "cispo")
    monkeypatch.setenv("SPADE_LEARNER_LOSS__KL_COEF", "0.005")
    monkeypatch.setenv("SPADE_LEARNER_REWARDS__VALIDITY_SHAPING_WEIGHT", "0.1")
    s = LearnerSettings()
    assert isinstance(s.loss, CispoLossConfig) and s.loss.kl_coef == 0.005
    assert s.rewards.validity_shaping_weight == 0.1


def test_bad_settings_are_refused_with_the_fix():
    with pytest.raises(ValidationError, match="SPADE_LEARNER_MODEL_PATH"):
        LearnerSettings()
    with pytest.raises(ValidationError, match="min_agent_groups"):
        LearnerSettings(dev_mode=True, min_agent_groups=5, agent_groups_per_step=2)
    with pytest.raises(ValidationError, match="zero_low < low"):
        LearnerSettings.model_validate({"dev_mode": True, "rewards": {"plateau_low": 0.1}})
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
