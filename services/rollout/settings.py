"""Typed settings of the rollout service, built once in its entry point and passed down.

Environment variables use the prefix ``SPADE_ROLLOUT_`` and ``__`` for nesting, e.g.
``SPADE_ROLLOUT_GROUP_SIZE=16``, ``SPADE_ROLLOUT_SANDBOX__TARGET=sandbox:50051``,
``SPADE_ROLLOUT_QUEUE='{"kind": "redis", "url": "redis://redis:6379/0"}'``. A YAML/JSON file can be
given with ``spade serve rollout --config FILE``; its values win over the environment.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Discriminator, Field, SecretStr, Tag, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.rollout.core.episode import PlayLimits
from spade.envs import CheckConfig
from spade.queues.config import InProcessQueueConfig, RedisQueueConfig


class GrpcSandbox(BaseModel):
    """Play through the sandbox service (distributed mode)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["grpc"] = "grpc"
    target: str = Field(default="127.0.0.1:50051", min_length=3, description="host:port of the sandbox's gRPC server.")
    api_key: SecretStr | None = Field(
        default=None, description="The rollout's sandbox tenant key (unset only in dev mode)."
    )
    open_timeout_s: float = Field(default=60.0, gt=0, le=3600, description="Longest wait for a session to open.")


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
    Annotated[GrpcSandbox, Tag("grpc")] | Annotated[PoolSandbox, Tag("pool")], Discriminator(_kind("grpc"))
]


class GrpcMemory(BaseModel):
    """The memory service over gRPC (distributed mode)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["grpc"] = "grpc"
    target: str = Field(default="127.0.0.1:50052", min_length=3, description="host:port of the memory's gRPC server.")
    timeout_s: float = Field(default=30.0, gt=0, le=600, description="Per-call deadline.")


class SqlMemory(BaseModel):
    """The memory store opened in this process (embedded mode; migrated on start)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["sql"] = "sql"
    url: str = Field(
        default="sqlite:///spade-memory.db", min_length=8, description="SQLAlchemy URL of the memory database."
    )


MemoryConfig = Annotated[
    Annotated[GrpcMemory, Tag("grpc")] | Annotated[SqlMemory, Tag("sql")], Discriminator(_kind("grpc"))
]
QueueConfig = Annotated[
    Annotated[RedisQueueConfig, Tag("redis")] | Annotated[InProcessQueueConfig, Tag("inprocess")],
    Discriminator(_kind("redis")),
]


def _default_consumer() -> str:
    return f"rollout-{socket.gethostname()}-{os.getpid()}"


class RolloutSettings(BaseSettings):
    """Settings of ``spade serve rollout`` (and of the rollout role in ``spade run``)."""

    model_config = SettingsConfigDict(env_prefix="SPADE_ROLLOUT_", env_nested_delimiter="__", extra="forbid")

    dev_mode: bool = Field(default=False, description="Allow unsafe defaults (sandbox without an API key).")

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
    sandbox_retries: int = Field(default=2, ge=0, le=100, description="Retries of a play after a sandbox fault.")
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
    sandbox: SandboxConfig = Field(default=GrpcSandbox.model_validate({}), description="Where envs are played.")
    memory: MemoryConfig = Field(default=GrpcMemory.model_validate({}), description="The environment memory.")
    inference_urls: list[str] = Field(
        default_factory=lambda: ["http://127.0.0.1:30000"], min_length=1, description="Inference workers' URLs."
    )
    tokenizer_path: Path | None = Field(
        default=None, description="The policy's checkpoint directory (its tokenizer); unset: the default SmolLM2 model."
    )

    @model_validator(mode="after")
    def _refuse_unsafe(self) -> RolloutSettings:
        if isinstance(self.sandbox, GrpcSandbox) and self.sandbox.api_key is None and not self.dev_mode:
            raise ValueError(
                "the sandbox has no API key: set SPADE_ROLLOUT_SANDBOX__API_KEY to the rollout's tenant key, "
                "or SPADE_ROLLOUT_DEV_MODE=true for anonymous local use"
            )
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

    @classmethod
    def load(cls, path: Path | None = None, **overrides: Any) -> RolloutSettings:
        """Settings from the environment, then ``path`` (YAML or JSON), then ``overrides``.

        Raises:
            ValueError: The file is not a mapping, or a value breaks a bound (pydantic names it).
        """
        data: dict[str, Any] = {}
        if path is not None:
            loaded = yaml.safe_load(path.read_text())
            if loaded is None:
                loaded = {}
            if not isinstance(loaded, dict):
                raise ValueError(f"{path} must hold a mapping of rollout settings, got {type(loaded).__name__}")
            data.update(loaded)
        data.update(overrides)
        return cls(**data)
