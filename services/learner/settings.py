"""Settings of the learner (env prefix ``SPADE_LEARNER_``, nested fields with ``__``), built once.

Defaults are the paper's where it has one (clip 0.2/0.28, TIS cap 2, AdamW lr 1e-6, weight decay
0.1, betas 0.9/0.98, regret scale 0.15, blend 0.4/0.6, plateau 0.15/0.4/0.6/0.85) and sized for
the embedded CPU run otherwise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_settings import SettingsConfigDict

from services.learner.core.losses import GrpoLossConfig, LossConfig
from services.learner.core.rewards import DesignerRewardConfig, PlateauBand
from services.learner.publisher import DEFAULT_RETRY
from spade.config import ServiceSettings
from spade.inference.discovery import InferenceDiscovery
from spade.queues.config import QueueConfig, RedisQueueConfig
from spade.retry import RetryPolicy


class RewardSettings(BaseModel):
    """The designer reward: blend weights, regret scale, plateau band, optional validity shaping."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    regret_weight: float = Field(default=0.4, ge=0.0, le=10.0, description="Weight of clip(regret/scale, 0, 1).")
    plateau_weight: float = Field(default=0.6, ge=0.0, le=10.0, description="Weight of plateau(window win rate).")
    regret_scale: float = Field(default=0.15, gt=0.0, le=1.0, description="Regret that saturates the regret term.")
    plateau_zero_low: float = Field(default=0.15, ge=0.0, le=1.0, description="Plateau rises from 0 here.")
    plateau_low: float = Field(default=0.4, ge=0.0, le=1.0, description="Start of the plateau's top.")
    plateau_high: float = Field(default=0.6, ge=0.0, le=1.0, description="End of the plateau's top.")
    plateau_zero_high: float = Field(default=0.85, ge=0.0, le=1.0, description="Win rate where it is back at 0.")
    validity_shaping_weight: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description="Reward per fraction of validation checks passed, for invalid attempts (0 = off).",
    )

    def to_config(self) -> DesignerRewardConfig:
        """The core's reward configuration."""
        return DesignerRewardConfig(
            regret_weight=self.regret_weight,
            plateau_weight=self.plateau_weight,
            regret_scale=self.regret_scale,
            band=PlateauBand(self.plateau_zero_low, self.plateau_low, self.plateau_high, self.plateau_zero_high),
            validity_shaping_weight=self.validity_shaping_weight,
        )


class LearnerSettings(ServiceSettings):
    """Everything the learner needs; see each field's description."""

    model_config = SettingsConfigDict(env_prefix="SPADE_LEARNER_")
    service_name = "learner"

    # --- model and files ---------------------------------------------------------------------------
    model_path: Path | None = Field(
        default=None, description="Base HF checkpoint to train. Default: the embedded SmolLM2-135M (dev mode only)."
    )
    checkpoint_dir: Path = Field(default=Path("spade-data/learner/checkpoints"), description="Checkpoint root.")
    weights_dir: Path = Field(default=Path("spade-data/learner/weights"), description="Published weight versions.")
    keep_checkpoints: int = Field(default=3, ge=1, le=1000, description="Newest checkpoints retained.")
    keep_weights: int = Field(default=3, ge=1, le=1000, description="Newest published weight versions retained.")
    checkpoint_every: int = Field(
        default=10,
        ge=1,
        le=100_000,
        description="Steps between checkpoints. Queue messages are acknowledged at checkpoints, so this "
        "also bounds the replay after a crash.",
    )
    resume: bool = Field(default=True, description="Resume from the newest checkpoint when there is one.")

    # --- optimisation ------------------------------------------------------------------------------
    loss: LossConfig = Field(default_factory=GrpoLossConfig, description="Policy loss variant (by its `type`).")
    lr: float = Field(default=1e-6, gt=0.0, le=1.0, description="AdamW learning rate.")
    weight_decay: float = Field(default=0.1, ge=0.0, le=1.0, description="AdamW weight decay.")
    beta1: float = Field(default=0.9, ge=0.0, lt=1.0, description="AdamW beta1.")
    beta2: float = Field(default=0.98, ge=0.0, lt=1.0, description="AdamW beta2.")
    grad_clip: float = Field(default=1.0, gt=0.0, le=1e6, description="Max global gradient norm.")
    micro_batch_tokens: int = Field(
        default=8192, ge=16, le=10_000_000, description="Tokens per micro-batch (packed: one forward/backward pass)."
    )
    temperature: float = Field(
        default=0.6,
        gt=0.0,
        le=10.0,
        description="Sampling temperature of the rollout/designer: logprobs are computed at it to match.",
    )
    bf16: bool = Field(default=True, description="bf16 autocast on GPU (ignored on CPU).")
    device: Literal["auto", "cpu", "cuda"] = Field(default="auto", description="Training device.")
    seed: int = Field(default=0, ge=0, description="torch seed.")

    # --- batches -----------------------------------------------------------------------------------
    agent_group_size: int = Field(
        default=8,
        ge=1,
        le=4096,
        description="Plays per group (one env at one version); a group is complete at this size.",
    )
    agent_groups_per_step: int = Field(default=4, ge=1, le=100_000, description="Complete agent groups per step.")
    min_agent_groups: int = Field(
        default=1, ge=0, le=100_000, description="Fewest complete groups that make a step when the fill times out."
    )
    fill_timeout_s: float = Field(
        default=30.0, gt=0.0, le=86_400, description="Longest wait for a full step before training on what is ready."
    )
    max_staleness: int = Field(
        default=4, ge=0, le=10_000, description="Agent samples older than this many weight versions are dropped."
    )
    train_on_hinted: bool = Field(default=False, description="Also train on hinted plays (their own groups).")
    role_normalization: bool = Field(default=True, description="Scale each role's advantages to unit std per step.")

    # --- designer rewards --------------------------------------------------------------------------
    window_versions: int = Field(
        default=4,
        ge=1,
        le=10_000,
        description="k: a designer sample is scored k versions after its env's first.",
    )
    window_grace_versions: int = Field(
        default=2,
        ge=0,
        le=10_000,
        description="Extra versions a designer sample waits for late plays of its window before being scored.",
    )
    rewards: RewardSettings = Field(default_factory=RewardSettings, description="Designer reward constants.")

    # --- publishing --------------------------------------------------------------------------------
    publish_every: int = Field(default=1, ge=1, le=100_000, description="Steps between weight publications.")
    inference_urls: list[str] = Field(
        default_factory=list, description="Inference workers to update (SGLang or the embedded server)."
    )
    inference_discovery: InferenceDiscovery | None = Field(
        default=None,
        description="In a cluster: follow this Service's EndpointSlices for the inference workers "
        "(inference_urls is then only the start); unset: inference_urls as given.",
    )
    retry: RetryPolicy = Field(
        default=DEFAULT_RETRY,
        description="Rounds of a weight publication for the workers that failed (the first included) and "
        "the pauses between them; each worker's request is also tried twice per round.",
    )
    publish_timeout_s: float = Field(default=600.0, gt=0.0, le=86_400, description="Per-worker weight load timeout.")
    require_all_workers: bool = Field(
        default=False, description="Stop the learner when a worker never acknowledges (else: report it unhealthy)."
    )

    # --- queue -------------------------------------------------------------------------------------
    queue: QueueConfig = Field(default_factory=RedisQueueConfig, description="Work queue backend.")
    consumer_group: str = Field(default="learner", min_length=1, max_length=200, description="Queue consumer group.")
    consumer_name: str = Field(default="learner-0", min_length=1, max_length=200, description="This consumer's name.")

    def unsafe_settings(self) -> list[str]:
        if self.model_path is None:
            return [
                f"model_path is required: set {self.env_name('model_path')}=<HF checkpoint dir> (the embedded "
                "SmolLM2-135M default is for local development)"
            ]
        return []

    @model_validator(mode="after")
    def _check(self) -> LearnerSettings:
        if self.min_agent_groups > self.agent_groups_per_step:
            raise ValueError(
                f"min_agent_groups ({self.min_agent_groups}) cannot exceed agent_groups_per_step "
                f"({self.agent_groups_per_step})"
            )
        self.rewards.to_config()  # the band's ordering is checked there
        return self
