"""Settings of the learner (env prefix ``SPADE_LEARNER_``, nested fields with ``__``), built once.

Defaults are the paper's where it has one (clip 0.2/0.28, TIS cap 2, AdamW lr 1e-6, weight decay
0.1, betas 0.9/0.98) and sized for the embedded CPU run otherwise.

The fields the run spec decides (``SPEC_FIELDS``: sampling temperature, G, k per setting, the
designer blend's constants) keep the spec's names and are unset by default: the learner then takes
the spec's values (``spade.runspec.RunSpec``; distributed: read from the memory at start, embedded:
given by the run). Set and different, they stop the learner at start with one line per field
(:meth:`LearnerSettings.check_spec`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_settings import SettingsConfigDict

from services.learner.core.losses import GrpoLossConfig, LossConfig
from services.learner.publisher import DEFAULT_RETRY
from spade.config import ConfigError, ServiceSettings
from spade.endpoints import InferenceEndpoint, MemoryEndpoint
from spade.inference.discovery import InferenceDiscovery
from spade.queues.config import QueueConfig, RedisQueueConfig
from spade.retry import RetryPolicy
from spade.runspec import RunSpec

SPEC_FIELDS = ("temperature", "group_size", "window_versions_game", "window_versions_tool")
"""The learner's settings that the run spec decides (same names as ``spade.runspec.RunSpec``'s fields);
the reward constants (``rewards.*``) are the spec's ``rewards`` section."""


class SpecContradiction(ConfigError):
    """The learner's own configuration contradicts the run spec (one line per field)."""


class RewardOverrides(BaseModel):
    """The designer blend's constants as this learner is configured; unset fields take the run spec's.

    Same names and bounds as ``spade.runspec.RewardConstants``; only a value that is set is compared.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    regret_weight: float | None = Field(
        default=None, ge=0.0, le=10.0, description="Weight of regret_norm in the blend; unset: the run spec's."
    )
    plateau_weight: float | None = Field(
        default=None, ge=0.0, le=10.0, description="Weight of plateau(w) in the blend; unset: the run spec's."
    )
    regret_scale: float | None = Field(
        default=None, gt=0.0, le=1.0, description="Regret that saturates regret_norm; unset: the run spec's."
    )
    plateau_band: tuple[float, float, float, float] | None = Field(
        default=None, description="plateau zero_low, low, high, zero_high; unset: the run spec's."
    )
    validity_shaping_weight: float | None = Field(
        default=None,
        ge=0.0,
        le=1.0,
        description="Validity shaping of invalid attempts, -w * (1 - fraction of checks passed) (0: off); unset: "
        "the run spec's.",
    )


class LearnerSettings(ServiceSettings):
    """Everything the learner needs; see each field's description."""

    model_config = SettingsConfigDict(env_prefix="SPADE_LEARNER_")
    service_name = "learner"

    # --- model and files ---------------------------------------------------------------------------
    model_path: Path | None = Field(
        default=None, description="Base HF checkpoint to train. Default: the embedded SmolLM2-135M (dev mode only)."
    )
    checkpoint_dir: Path = Field(
        default=Path("spade-data/learner/checkpoints"),
        description="Checkpoint root; also holds the sample journal (received samples, fsynced before they are "
        "acknowledged).",
    )
    weights_dir: Path = Field(default=Path("spade-data/learner/weights"), description="Published weight versions.")
    keep_checkpoints: int = Field(default=3, ge=1, le=1000, description="Newest checkpoints retained.")
    keep_weights: int = Field(default=3, ge=1, le=1000, description="Newest published weight versions retained.")
    checkpoint_every: int = Field(
        default=10,
        ge=1,
        le=100_000,
        description="Steps between checkpoints of versions that are not published (every published version is "
        "checkpointed before it is published, and SIGTERM checkpoints too). Samples are durable in the journal "
        "between checkpoints; this bounds how much of it a restart replays.",
    )
    resume: bool = Field(
        default=True, description="Resume from the newest checkpoint (and the journal) when there is one."
    )

    # --- the run spec (distributed: read from the memory at start; embedded: given by the run) ------
    run_spec_file: Path | None = Field(
        default=None,
        description="A run spec file (YAML/JSON of RunSpec fields) stored in the memory when none is stored yet; "
        "unset: wait until one is (`spade runspec set FILE`).",
    )
    memory: MemoryEndpoint = Field(
        default_factory=MemoryEndpoint, description="The memory, where the run spec is read at start (distributed)."
    )
    spec_wait_log_s: float = Field(
        default=30.0, gt=0.0, le=3600, description="Seconds between two log lines while waiting for a run spec."
    )
    temperature: float | None = Field(
        default=None,
        gt=0.0,
        le=2.0,
        description="Sampling temperature of both roles (logprobs are computed at it to match the rollout's); "
        "unset: the run spec's.",
    )
    group_size: int | None = Field(
        default=None,
        ge=2,
        le=1024,
        description="G: plays per group (one env, one window slot, one arm); a group is complete at this size; "
        "unset: the run spec's.",
    )
    window_versions_game: int | None = Field(
        default=None, ge=1, le=1000, description="k of game envs (window slots); unset: the run spec's."
    )
    window_versions_tool: int | None = Field(
        default=None, ge=1, le=1000, description="k of tool envs (window slots); unset: the run spec's."
    )
    rewards: RewardOverrides = Field(
        default_factory=RewardOverrides, description="The designer blend's constants; unset fields: the run spec's."
    )

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
    bf16: bool = Field(default=True, description="bf16 autocast on GPU (ignored on CPU).")
    cpu_bf16: bool = Field(
        default=False,
        description="bf16 autocast on the CPU too (fp32 master weights, gradients and optimiser state). Meant for "
        "a CPU with native bf16 (AVX-512 BF16 or AMX), where a training step is ~1.8x as fast; the learner's "
        "logprobs then differ from an fp32 rollout's by ~1e-2, which truncated importance sampling corrects.",
    )
    share_prefixes: bool = Field(
        default=True,
        description="Compute once the tokens a step's samples begin with alike (the G plays of an env share "
        "their prompt): the same logprobs, 27-50% fewer tokens a step in the default embedded run (docs/learner.md). "
        "Only where the model's attention is plain causal (segment attention); false lays every sample out whole.",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(default="auto", description="Training device.")
    seed: int = Field(default=0, ge=0, description="torch seed.")

    # --- batches -----------------------------------------------------------------------------------
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
    resource_fault_policy: Literal["drop", "zero"] = Field(
        default="drop",
        description="Agent plays that ended in a resource fault (the env hit a cpu/memory/output/wall-clock limit "
        "or was killed): `drop` never trains on them (the group's advantages come from its other plays), `zero` "
        "trains on them as return 0. Counted per reason either way; the designer's window counts them as 0.",
    )

    # --- designer rewards --------------------------------------------------------------------------
    window_grace_versions: int = Field(
        default=2,
        ge=0,
        le=10_000,
        description="Versions past its window's end (window_start + k) a designer sample waits for late plays "
        "before it is scored with what arrived.",
    )
    first_play_grace_versions: int = Field(
        default=8,
        ge=0,
        le=10_000,
        description="Versions past design + k + window_grace_versions a designer sample waits for its env's first "
        "play (the rollout fixes the window then) before it is recorded unscored (reason `no_plays`).",
    )
    skill_baseline_length: int = Field(
        default=32,
        ge=1,
        le=100_000,
        description="Recent blends of a skill whose mean centres a round's skill group of fewer than 2 scored envs "
        "(persisted with the checkpoint).",
    )

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
    inference: InferenceEndpoint = Field(
        default_factory=InferenceEndpoint,
        description="Key (an admin key: weight updates need one off loopback) and TLS for the inference servers "
        "(SPADE_LEARNER_INFERENCE__API_KEY).",
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
    wait_log_s: float = Field(
        default=30.0, gt=0.0, le=3600, description="Seconds between two log lines while a step waits for samples."
    )

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
        return self

    def spec_values(self) -> dict[str, Any]:
        """The run spec's fields as this learner is configured (``None``: not set, take the spec's)."""
        values: dict[str, Any] = {name: getattr(self, name) for name in SPEC_FIELDS}
        values.update({f"rewards.{name}": getattr(self.rewards, name) for name in RewardOverrides.model_fields})
        return values

    def check_spec(self, spec: RunSpec) -> None:
        """Refuse a run spec this configuration contradicts.

        Raises:
            SpecContradiction: One line per contradicting field, naming its variable and the fix.
        """
        problems = spec.contradictions(self.spec_values())
        if problems:
            lines = []
            for p in problems:
                variable = self.env_name(*p.split(":", 1)[0].split("."))
                lines.append(f"{p}; set by {variable}: unset it (the run spec decides) or change the spec")
            raise SpecContradiction("\n".join(lines))
