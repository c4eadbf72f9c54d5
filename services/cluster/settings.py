"""Settings of the process runner (``SPADE_CLUSTER_*``, read from the env file and the environment)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator
from pydantic_settings import NoDecode, SettingsConfigDict

from spade.config import ServiceSettings
from spade.envs.types import Setting

Role = Literal["sandbox", "memory", "inference", "learner", "rollout", "designer"]
ROLES: tuple[Role, ...] = ("sandbox", "memory", "inference", "learner", "rollout", "designer")
"""Every service, in start order (each waits for the ones before it to be healthy)."""


class ClusterSettings(ServiceSettings):
    """How ``spade cluster`` runs the services as processes of this machine."""

    model_config = SettingsConfigDict(env_prefix="SPADE_CLUSTER_")
    service_name = "cluster"

    run_dir: Path = Field(
        default=Path(".spade-cluster"),
        description="Where the runner keeps each process's log (logs/NAME.log), its pid (state.json) and the "
        "generated keys (keys.env, mode 0600).",
    )
    services: Annotated[list[Role], NoDecode] = Field(
        default_factory=lambda: list(ROLES),
        min_length=1,
        description="The services to run (comma-separated or a JSON list); started in the order of ROLES.",
    )
    rollout_workers: int = Field(
        default=2, ge=1, le=32, description="Rollout worker processes, named rollout-1..N (their consumer names)."
    )
    run_spec: Path | None = Field(
        default=None,
        description="YAML/JSON run spec stored in the memory once it is up (`spade runspec set`); a different "
        "stored spec is an error. Unset: the memory's stored spec (or its own run_spec_file).",
    )
    seed_examples: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["number_hunt"],
        description="Example envs to load as the seed pool (`spade envs seed --example`); empty: none.",
    )
    seed_setting: Setting = Field(default=Setting.GAME, description="Setting of the seed pool.")
    seed_window: int = Field(
        default=0,
        ge=0,
        le=1_000_000,
        description="Versions the seed envs stay active (0: the run spec's k); a long window keeps a CPU run "
        "training while the designer's envs are still invalid.",
    )
    health_timeout_s: float = Field(
        default=900.0, gt=0, le=7200, description="Longest wait for one service to become healthy."
    )
    stop_grace_s: float = Field(
        default=40.0, gt=0, le=3600, description="How long `down` waits after SIGTERM before SIGKILL."
    )

    @field_validator("services", "seed_examples", mode="before")
    @classmethod
    def _comma_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            if value.strip().startswith("["):
                return json.loads(value)
            return [item.strip() for item in value.split(",") if item.strip()]
        return value
