"""Settings of ``spade eval`` (environment prefix ``SPADE_EVAL_``; nested sections with ``__``).

The command line sets the run's own choices (``--model``, ``--suite``, ``--limit``, ``--seed``,
``--out``); everything else lives here, e.g. ``SPADE_EVAL_CONCURRENCY=4``,
``SPADE_EVAL_REASONING_GYM__ITEMS_PER_CATEGORY=10``, ``SPADE_EVAL_POOL__SEEDS_PER_ENV=8`` or a YAML
file passed with ``--config``.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_settings import SettingsConfigDict

from services.eval.core.bootstrap import DEFAULT_CONFIDENCE, DEFAULT_RESAMPLES
from services.eval.suites.bfcl import CATEGORIES as BFCL_CATEGORIES
from services.eval.suites.bfcl import Category as BfclCategory
from services.eval.suites.reasoning_gym import DEFAULT_DATASETS
from spade.agent.episode import PlayLimits
from spade.config import ServiceSettings
from spade.endpoints import PoolSandbox, SandboxConfig
from spade.envs.types import Setting
from spade.retry import RetryPolicy

SUITES: tuple[str, ...] = ("reasoning-gym", "bfcl-multi-turn", "pool")
"""The suites ``spade eval --suite`` knows."""

SUITE_SAMPLING: dict[str, tuple[float, int]] = {
    "reasoning-gym": (0.6, 1024),  # the paper's GEM eval samples at 0.6
    "bfcl-multi-turn": (0.0, 512),  # the paper's BFCL eval is greedy
    "pool": (PlayLimits.temperature, PlayLimits.max_tokens_per_turn),  # as the rollout plays
}
"""Each suite's default ``(temperature, max_new_tokens)`` when the settings leave them unset."""


class ReasoningGymSettings(BaseModel):
    """The ``reasoning-gym`` suite."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    datasets: list[str] = Field(
        default_factory=lambda: list(DEFAULT_DATASETS),
        min_length=1,
        max_length=200,
        description="Reasoning-Gym datasets to draw items from (each at its hardest curriculum level).",
    )
    items_per_category: int = Field(
        default=25, ge=1, le=100_000, description="Items per category (4 categories: 100 items by default)."
    )


class BfclSettings(BaseModel):
    """The ``bfcl-multi-turn`` suite."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    categories: list[BfclCategory] = Field(
        default_factory=lambda: list(BFCL_CATEGORIES), min_length=1, description="BFCL multi-turn categories."
    )
    items_per_category: int | None = Field(
        default=None, ge=1, le=100_000, description="Entries per category, a seeded sample (unset: all 200)."
    )
    max_steps: int | None = Field(
        default=None,
        ge=1,
        le=1000,
        description="Model steps per user turn before BFCL's force-quit (unset: BFCL's 20).",
    )


class PoolSettings(BaseModel):
    """The ``pool`` suite."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    source: str | None = Field(
        default=None,
        max_length=2000,
        description="The pool: a run directory, its memory.db, a JSONL export or a SQLAlchemy URL (--pool).",
    )
    setting: Setting | None = Field(default=None, description="Only envs of this setting (unset: both).")
    seeds_per_env: int = Field(default=4, ge=1, le=10_000, description="Held-out plays per env.")
    max_turns: int = Field(default=PlayLimits.max_turns, ge=1, le=1000, description="Model turns per play.")
    max_tokens_per_turn: int = Field(
        default=PlayLimits.max_tokens_per_turn, ge=1, le=1_000_000, description="Tokens one model turn may generate."
    )
    max_total_tokens: int = Field(
        default=PlayLimits.max_total_tokens, ge=2, le=10_000_000, description="Length cap of a whole play."
    )
    sandbox: SandboxConfig = Field(
        default_factory=PoolSandbox,
        description="Where envs are played: an in-process isolated pool (kind pool, the default) or the sandbox "
        "service (kind grpc, with target and api_key).",
    )
    retry: RetryPolicy = Field(
        default_factory=lambda: RetryPolicy(attempts=3),
        description="Tries of a play hit by a sandbox fault before the eval stops (resumable).",
    )


class EvalSettings(ServiceSettings):
    """Settings of ``spade eval``."""

    model_config = SettingsConfigDict(env_prefix="SPADE_EVAL_")
    service_name = "eval"

    concurrency: int = Field(default=8, ge=1, le=4096, description="Items evaluated at once.")
    temperature: float | None = Field(
        default=None, ge=0.0, le=10.0, description="Sampling temperature (unset: the suite's default; 0: greedy)."
    )
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    max_new_tokens: int | None = Field(
        default=None, ge=1, le=1_000_000, description="Tokens one reply may generate (unset: the suite's default)."
    )
    batch_invariant: bool = Field(
        default=True,
        description="Ask the server to compute each reply batch-invariantly, so an item at the same weights and "
        "seed gets the same reply whatever the concurrency or other traffic (the embedded server honours it per "
        "request; SGLang only with --enable-deterministic-inference, else the run header says 'unsupported').",
    )
    bootstrap_resamples: int = Field(
        default=DEFAULT_RESAMPLES, ge=100, le=1_000_000, description="Bootstrap resamples of each interval."
    )
    confidence: float = Field(
        default=DEFAULT_CONFIDENCE, gt=0.5, lt=1.0, description="Coverage of the reported intervals."
    )
    torch_threads: int | None = Field(
        default=None, ge=1, le=512, description="torch threads of the embedded server (a checkpoint --model)."
    )
    ready_timeout_s: float = Field(
        default=300.0, gt=0, le=86_400, description="How long to wait for the inference server to become ready."
    )
    request_timeout_s: float = Field(
        default=1800.0, gt=0, le=86_400, description="Read timeout of one generation request."
    )
    reasoning_gym: ReasoningGymSettings = Field(
        default_factory=ReasoningGymSettings, description="The reasoning-gym suite."
    )
    bfcl: BfclSettings = Field(default_factory=BfclSettings, description="The bfcl-multi-turn suite.")
    pool: PoolSettings = Field(default_factory=PoolSettings, description="The pool suite.")

    @field_validator("reasoning_gym")
    @classmethod
    def _unique_datasets(cls, value: ReasoningGymSettings) -> ReasoningGymSettings:
        if len(set(value.datasets)) != len(value.datasets):
            raise ValueError(f"reasoning_gym.datasets lists a dataset twice: {value.datasets}")
        return value

    def unsafe_settings(self) -> list[str]:
        sandbox = self.pool.sandbox
        if isinstance(sandbox, PoolSandbox) and sandbox.isolation.get("allow_degraded"):
            return [
                f"{self.env_name('pool', 'sandbox')} allows degraded isolation layers "
                f"{sandbox.isolation['allow_degraded']}: install them (scripts/setup.sh) or drop allow_degraded"
            ]
        if not isinstance(sandbox, PoolSandbox) and sandbox.api_key is None:
            return [f"the sandbox has no API key: set {self.env_name('pool', 'sandbox', 'api_key')}"]
        return []

    def sampling_for(self, suite: str) -> tuple[float, int]:
        """``(temperature, max_new_tokens)`` of ``suite``: these settings, else the suite's defaults."""
        temperature, max_new_tokens = SUITE_SAMPLING[suite]
        if suite == "pool":
            max_new_tokens = self.pool.max_tokens_per_turn
        return (
            self.temperature if self.temperature is not None else temperature,
            self.max_new_tokens if self.max_new_tokens is not None else max_new_tokens,
        )
