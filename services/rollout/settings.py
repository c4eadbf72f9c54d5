"""Typed settings of the rollout service, built once in its entry point and passed down.

Environment variables use the prefix ``SPADE_ROLLOUT_`` and ``__`` for nesting, e.g.
``SPADE_ROLLOUT_CONSUMER_NAME=rollout-0``, ``SPADE_ROLLOUT_SANDBOX__TARGET=sandbox:50051``,
``SPADE_ROLLOUT_QUEUE__URL=redis://redis:6379/0``. A YAML/JSON file can be given with
``spade serve rollout --config FILE``; its values win over the environment.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator
from pydantic_settings import SettingsConfigDict

from spade.agent.episode import PlayLimits
from spade.config import ConfigError, ServiceSettings
from spade.endpoints import InferenceEndpoint, MemoryEndpoint, SandboxConfig, SandboxEndpoint, kind_of
from spade.inference.client import DEFAULT_RETRY
from spade.inference.discovery import InferenceDiscovery
from spade.queues.config import QueueConfig, RedisQueueConfig
from spade.retry import RetryPolicy
from spade.runspec import RunSpec


class SqlMemory(BaseModel):
    """The memory store opened in this process (embedded mode; migrated on start)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["sql"] = "sql"
    url: str = Field(
        default="sqlite:///spade-memory.db", min_length=8, description="SQLAlchemy URL of the memory database."
    )


MemoryConfig = Annotated[
    Annotated[MemoryEndpoint, Tag("grpc")] | Annotated[SqlMemory, Tag("sql")], Discriminator(kind_of("grpc"))
]
"""The environment memory: the memory service (``grpc``, the default) or its database directly (``sql``)."""


def _default_consumer() -> str:
    # Stable across restarts of the same machine or container (never the pid): a restarted worker
    # takes its own leases back at once. In Kubernetes the deployment sets the pod name.
    return f"rollout-{socket.gethostname()}"


SPEC_FIELDS = (
    "temperature",
    "top_p",
    "group_size",
    "window_versions_game",
    "window_versions_tool",
    "agent_max_turns",
    "agent_max_tokens_per_turn",
    "agent_max_total_tokens",
)
"""The rollout's settings that the run spec decides (same names as ``spade.runspec.RunSpec``'s fields)."""


class RolloutSettings(ServiceSettings):
    """Settings of ``spade serve rollout`` (and of the rollout role in ``spade run``).

    The fields named in ``SPEC_FIELDS`` belong to the run spec: left unset (the default) they take
    the spec's value; set, they must equal it, or the service refuses to start naming the field.
    """

    model_config = SettingsConfigDict(env_prefix="SPADE_ROLLOUT_")
    service_name = "rollout"

    # The run spec (distributed: read from the memory at start; embedded: given by the run).
    run_spec_file: Path | None = Field(
        default=None,
        description="A run spec file (YAML/JSON of RunSpec fields) stored in the memory when none is stored "
        "yet; unset: wait until one is (`spade runspec set FILE`).",
    )
    temperature: float | None = Field(
        default=None, gt=0.0, le=2.0, description="Sampling temperature; unset: the run spec's."
    )
    top_p: float | None = Field(
        default=None, gt=0.0, le=1.0, description="Nucleus sampling mass; unset: the run spec's."
    )
    group_size: int | None = Field(
        default=None, ge=2, le=1024, description="G: seeds per env and slot (both arms); unset: the run spec's."
    )
    window_versions_game: int | None = Field(
        default=None, ge=1, le=1000, description="k of game envs (slots per window); unset: the run spec's."
    )
    window_versions_tool: int | None = Field(
        default=None, ge=1, le=1000, description="k of tool envs (slots per window); unset: the run spec's."
    )
    agent_max_turns: int | None = Field(
        default=None, ge=1, le=1000, description="The agent's turn budget per play; unset: the run spec's."
    )
    agent_max_tokens_per_turn: int | None = Field(
        default=None, ge=1, le=1_000_000, description="Tokens one agent turn may generate; unset: the run spec's."
    )
    agent_max_total_tokens: int | None = Field(
        default=None, ge=64, le=10_000_000, description="Length cap of one trajectory; unset: the run spec's."
    )

    # What is played and published.
    publish_hinted: bool = Field(
        default=True,
        description="Send hinted plays to samples.agent (hinted=true); the learner decides whether to train.",
    )
    drop_mixed_version_plays: bool = Field(
        default=False,
        description="Drop plays whose turns span weight versions instead of labelling them with the oldest.",
    )
    top_k: int = Field(default=-1, ge=-1, le=1_000_000, description="Top-k cut-off; -1 disables it.")
    sampling_run: str | None = Field(
        default=None,
        min_length=1,
        max_length=200,
        description="The run identity every sampling seed is derived from; unset: the run spec's id "
        "(two runs of one spec then sample alike, which makes a rerun reproducible).",
    )

    # Concurrency, leases and fault handling.
    consumer_group: str = Field(
        default="rollout", min_length=1, max_length=200, description="Queue group shared by workers."
    )
    consumer_name: str = Field(
        default_factory=_default_consumer,
        min_length=1,
        max_length=200,
        description="This worker's stable identity (its leases and its Redis consumer): the pod name in "
        "Kubernetes, else a configured name; default rollout-<hostname>. Unique among live workers.",
    )
    max_concurrent_plays: int = Field(default=8, ge=1, le=10_000, description="Plays in flight in this worker.")
    max_concurrent_envs: int = Field(
        default=4, ge=1, le=10_000, description="Window slots (one env each) this worker plays at once."
    )
    max_concurrent_audit_plays: int = Field(
        default=16,
        ge=1,
        le=10_000,
        description="Audit plays in flight in this worker, besides max_concurrent_plays (they call no model and "
        "spend their time waiting a real turn's pace). Each holds a sandbox session: the rollout's sandbox "
        "key must allow max_concurrent_plays + max_concurrent_audit_plays sessions.",
    )
    audit_paced: bool = Field(
        default=True,
        description="Each audit turn waits a gap drawn from the real plays' recent turn gaps (the time a "
        "turn's generation takes) before it steps, so an env that times its calls cannot tell its audit from "
        "a real play (docs/rollout.md). Off only to measure what the pacing costs.",
    )
    retry: RetryPolicy = Field(
        default=DEFAULT_RETRY,
        description="Tries of a play after a sandbox fault, and of an inference request after a transient "
        "failure (each with its back-off).",
    )
    max_attempts: int = Field(
        default=5,
        ge=1,
        le=1000,
        description="Claims of one window slot that end without it done before it is skipped with the reason "
        "recorded (at slot 0 the window closes unplayed): poison work must not circle forever.",
    )
    lease_s: float = Field(
        default=15.0,
        ge=1.0,
        le=3600.0,
        description="Lease on a slot being played, renewed every lease_s/3 while the plays run: a dead worker's "
        "slot is taken over within this time. Also the back-off before a failed slot is tried again.",
    )
    shutdown_grace_s: float = Field(
        default=20.0,
        ge=0.0,
        le=3600.0,
        description="On SIGTERM, how long slots in flight may finish before they are cancelled (finished plays "
        "are kept, leases handed back at once).",
    )
    zero_variance_extensions: int = Field(
        default=1,
        ge=0,
        le=16,
        description="When a slot's unhinted returns are all equal (no signal to train on), play G fresh seeds "
        "of the same slot (both arms at slot 0), at most this many times (0: never extend).",
    )
    poll_s: float = Field(default=1.0, gt=0, le=3600, description="Idle wait between looks for due slots.")
    block_ms: int = Field(default=1000, ge=1, le=60_000, description="How long a queue read blocks.")

    # Where things are.
    state_url: str = Field(
        default="sqlite:///spade-rollout.db",
        min_length=8,
        description="SQLAlchemy URL of the rollout's state tables (Postgres shared by all workers).",
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
    inference: InferenceEndpoint = Field(
        default_factory=InferenceEndpoint,
        description="Key (one of the servers' api_keys, when they have any) and TLS for the inference servers "
        "(SPADE_ROLLOUT_INFERENCE__API_KEY).",
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
        per_turn, total = self.agent_max_tokens_per_turn, self.agent_max_total_tokens
        if per_turn is not None and total is not None and per_turn >= total:
            raise ValueError(
                f"agent_max_tokens_per_turn ({per_turn}) must be below agent_max_total_tokens ({total}): "
                "the prompt needs room too"
            )
        return self

    def spec_values(self) -> dict[str, Any]:
        """The run spec's fields as this service is configured (None: not set, take the spec's)."""
        return {name: getattr(self, name) for name in SPEC_FIELDS}

    def check_spec(self, spec: RunSpec) -> None:
        """Refuse a run spec this configuration contradicts.

        Raises:
            SpecContradiction: One line per contradicting field, naming its variable and the fix.
        """
        problems = spec.contradictions(self.spec_values())
        if problems:
            lines = [
                f"{p}; set by {self.env_name(p.split(':', 1)[0])}: unset it (the run spec decides) or change the spec"
                for p in problems
            ]
            raise SpecContradiction("\n".join(lines))

    def play_limits(self, spec: RunSpec) -> PlayLimits:
        """The agent's budget and sampling of one play: the run spec's (``top_k`` is the rollout's own)."""
        return PlayLimits(
            max_turns=spec.agent_max_turns,
            max_tokens_per_turn=spec.agent_max_tokens_per_turn,
            max_total_tokens=spec.agent_max_total_tokens,
            temperature=spec.temperature,
            top_p=spec.top_p,
            top_k=self.top_k,
        )


class SpecContradiction(ConfigError):
    """The service's own configuration contradicts the run spec (one line per field)."""
