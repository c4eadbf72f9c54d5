"""Typed settings of the rollout service, built once in its entry point and passed down.

Environment variables use the prefix ``SPADE_ROLLOUT_`` and ``__`` for nesting, e.g.
``SPADE_ROLLOUT_GROUP_SIZE=16``, ``SPADE_ROLLOUT_SANDBOX__TARGET=sandbox:50051``,
``SPADE_ROLLOUT_QUEUE__URL=redis://redis:6379/0``. A YAML/JSON file can be given with
``spade serve rollout --config FILE``; its values win over the environment.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator
from pydantic_settings import SettingsConfigDict

from services.rollout.core.episode import PlayLimits
from spade.config import ServiceSettings
from spade.endpoints import MemoryEndpoint, SandboxEndpoint
from spade.envs import CheckConfig
from spade.inference.client import DEFAULT_RETRY
from spade.inference.discovery import InferenceDiscovery
from spade.queues.config import QueueConfig, RedisQueueConfig
from spade.retry import RetryPolicy


class PoolSandbox(BaseModel):
    """Play in an isolated worker pool started inside this process (embedded mode)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["pool"] = "pool"
    isolation: dict[str, Any] = Field(
        default_factory=dict, description="IsolationSettings fields for the pool (see the sandbox's settings)."
    )
    checks: CheckConfig = Field(default_factory=CheckConfig, description="Session limits (turn cap, observation size).")


def _kind(default: str) -> Callable[[Any], str]:
    """The ``kind`` tag of a variant, ``default`` when absent (``SPADE_ROLLOUT_SANDBOX__TARGET=…`` alone)."""

    def pick(value: Any) -> str:
        if isinstance(value, dict):
            return str(value.get("kind", default))
        return str(getattr(value, "kind", default))

    return pick


SandboxConfig = Annotated[
    Annotated[SandboxEndpoint, Tag("grpc")] | Annotated[PoolSandbox, Tag("pool")], Discriminator(_kind("grpc"))
]
"""Where envs are played: the sandbox service (``grpc``, the default) or an in-process pool (``pool``)."""


class SqlMemory(BaseModel):
    """The memory store opened in this process (embedded mode; migrated on start)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["sql"] = "sql"
    url: str = Field(
        default="sqlite:///spade-memory.db", min_length=8, description="SQLAlchemy URL of the memory database."
    )


MemoryConfig = Annotated[
    Annotated[MemoryEndpoint, Tag("grpc")] | Annotated[SqlMemory, Tag("sql")], Discriminator(_kind("grpc"))
]
"""The environment memory: the memory service (``grpc``, the default) or its database directly (``sql``)."""


def _default_consumer() -> str:
    return f"rollout-{socket.gethostname()}-{os.getpid()}"


class RolloutSettings(ServiceSettings):
    """Settings of ``spade serve rollout`` (and of the rollout role in ``spade run``)."""

    model_config = SettingsConfigDict(env_prefix="SPADE_ROLLOUT_")
    service_name = "rollout"

    # What is played.
    group_size: int = Field(
        default=8, ge=1, le=1024, description="G: seeds per env and version (both arms use the same G)."
    )
    window_versions: int = Field(
        default=4, ge=1, le=10_000, description="k: weight versions an env stays active; keep equal to the memory's."
    )
    publish_hinted: bool = Field(
        default=True,
        description="Send hinted plays to samples.agent (hinted=true); the learner decides whether to train.",
    )
    drop_mixed_version_plays: bool = Field(
        default=False,
        description="Drop plays whose turns span weight versions instead of labelling them with the oldest.",
    )

    # Limits of one play and sampling.
    max_turns: int = Field(default=8, ge=1, le=1000, description="Model turns per play.")
    max_tokens_per_turn: int = Field(default=512, ge=1, le=1_000_000, description="Tokens one model turn may generate.")
    max_total_tokens: int = Field(default=4096, ge=2, le=10_000_000, description="Length cap of a whole trajectory.")
    temperature: float = Field(default=0.6, ge=0.0, le=10.0, description="Sampling temperature (0: greedy).")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(default=-1, ge=-1, le=1_000_000, description="Top-k cut-off; -1 disables it.")

    # Concurrency and fault handling.
    consumer_group: str = Field(
        default="rollout", min_length=1, max_length=200, description="Queue group shared by workers."
    )
    consumer_name: str = Field(
        default_factory=_default_consumer, min_length=1, max_length=200, description="This worker's unique name."
    )
    max_concurrent_plays: int = Field(default=8, ge=1, le=10_000, description="Plays in flight in this worker.")
    retry: RetryPolicy = Field(
        default=DEFAULT_RETRY,
        description="Tries of a play after a sandbox fault, and of an inference request after a transient "
        "failure (each with its back-off).",
    )
    max_deliveries: int = Field(
        default=5,
        ge=1,
        le=1000,
        description="An env whose first plays failed on this many deliveries is closed unplayed (poison work).",
    )
    lease_s: float = Field(
        default=900.0, gt=0, le=86_400, description="A window play not finished by then is given to another worker."
    )
    poll_s: float = Field(default=1.0, gt=0, le=3600, description="Idle wait between looks for due window plays.")
    block_ms: int = Field(default=1000, ge=1, le=60_000, description="How long a queue read blocks.")

    # Where things are.
    state_url: str = Field(
        default="sqlite:///spade-rollout.db",
        min_length=8,
        description="SQLAlchemy URL of the rollout's active-set tables (Postgres shared by all workers).",
    )
    queue: QueueConfig = Field(default_factory=RedisQueueConfig, description="Work queue backend.")
    sandbox: SandboxConfig = Field(default_factory=SandboxEndpoint, description="Where envs are played.")
    memory: MemoryConfig = Field(default_factory=MemoryEndpoint, description="The environment memory.")
    inference_urls: list[str] = Field(
        default_factory=lambda: ["http://127.0.0.1:30000"], min_length=1, description="Inference workers' URLs."
    )
    inference_discovery: InferenceDiscovery | None = Field(
        default=None,
        description="In a cluster: follow this Service's EndpointSlices for the inference workers "
        "(inference_urls is then only the start); unset: inference_urls as given.",
    )
    tokenizer_path: Path | None = Field(
        default=None, description="The policy's checkpoint directory (its tokenizer); unset: the default SmolLM2 model."
    )

    def unsafe_settings(self) -> list[str]:
        if isinstance(self.sandbox, SandboxEndpoint) and self.sandbox.api_key is None:
            return [
                f"the sandbox has no API key: set {self.env_name('sandbox', 'api_key')} to the rollout's tenant key"
            ]
        return []

    @model_validator(mode="after")
    def _budgets(self) -> RolloutSettings:
        if self.max_tokens_per_turn >= self.max_total_tokens:
            raise ValueError(
                f"max_tokens_per_turn ({self.max_tokens_per_turn}) must be below max_total_tokens "
                f"({self.max_total_tokens}): the prompt needs room too"
            )
        return self

    def play_limits(self) -> PlayLimits:
        """The budgets and sampling of one play."""
        return PlayLimits(
            max_turns=self.max_turns,
            max_tokens_per_turn=self.max_tokens_per_turn,
            max_total_tokens=self.max_total_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
        )
