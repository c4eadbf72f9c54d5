"""Typed settings of the sandbox service, built once in the entry point.

Environment variables use the prefix ``SPADE_SANDBOX_`` and ``__`` for nesting, e.g.
``SPADE_SANDBOX_HTTP__PORT=8081``, ``SPADE_SANDBOX_ISOLATION__CPU_SECONDS=10``,
``SPADE_SANDBOX_API_KEYS='[{"tenant": "rl", "key_sha256": "<hex>"}]'`` (a key's ``role`` is ``write``,
running code, unless it says ``"role": "read"``: a monitoring key, for ``/healthz/details`` and
``/metrics`` only). A YAML/JSON file can be
given with ``spade serve sandbox --config FILE``; values from the file win over the environment.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from services.sandbox.core.requests import RequestLimits
from services.sandbox.isolation import IsolationSettings
from spade.auth import RoleKey, check_unique_keys
from spade.config import ServiceSettings
from spade.envs import CheckConfig
from spade.retry import RetryPolicy
from spade.serving.settings import ServerAddress


class SandboxApiKey(RoleKey):
    """One tenant's key (stored as a SHA-256 hex digest, never in clear), its role and its quotas.

    ``role``: ``write`` (the default) validates, executes and plays; ``read`` only reads
    ``/healthz/details`` and ``/metrics`` (a monitoring key); ``admin`` is ``write`` here.
    """

    max_sessions: int = Field(16, ge=1, le=10_000, description="Concurrent sessions this tenant may hold.")
    executions_per_minute: int = Field(
        120,
        ge=1,
        le=1_000_000,
        description="Runs (executions, validations and session opens; steps are not counted) per rolling minute.",
    )


class LocalQuotaSettings(BaseModel):
    """Quotas counted by this replica alone (dev mode, or one replica): N replicas give N times each quota."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["local"] = Field("local", description="Count quotas in this process.")


class RedisQuotaSettings(BaseModel):
    """Quotas counted in Redis, shared by every replica that names the same Redis and prefix."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["redis"] = Field("redis", description="Count quotas in Redis.")
    url: str = Field("redis://127.0.0.1:6379/0", min_length=1, description="Redis URL (redis:// or rediss://).")
    prefix: str = Field(
        "spade:sandbox:quota", min_length=1, max_length=200, description="Key prefix; replicas sharing quotas share it."
    )
    lease_s: float = Field(
        60.0,
        ge=5.0,
        le=3600.0,
        description="A session counts this long after its replica last renewed it (a dead replica's "
        "sessions stop counting after at most this).",
    )
    socket_timeout_s: float = Field(5.0, gt=0, le=300, description="Timeout of one Redis call, in seconds.")
    retry: RetryPolicy = Field(
        default_factory=lambda: RetryPolicy(attempts=3, initial_s=0.05, max_s=1.0, jitter_s=0.05),
        description="Tries of one quota call on a broken connection before the request is refused (503).",
    )


QuotaSettings = Annotated[LocalQuotaSettings | RedisQuotaSettings, Field(discriminator="kind")]
"""Where quotas are counted, chosen by ``kind``."""


class SandboxSettings(ServiceSettings):
    """Settings of ``spade serve sandbox`` (and of the embedded sandbox pool)."""

    model_config = SettingsConfigDict(env_prefix="SPADE_SANDBOX_")
    service_name = "sandbox"

    grpc: ServerAddress = Field(
        default=ServerAddress(host="127.0.0.1", port=50051), description="Where the gRPC server listens."
    )
    http: ServerAddress = Field(
        default=ServerAddress(host="127.0.0.1", port=8081), description="Where the REST server listens."
    )
    api_keys: list[SandboxApiKey] = Field(default_factory=list, description="Tenants allowed to call the service.")
    max_request_bytes: int = Field(
        8 * 2**20, ge=1024, le=2**30, description="Largest HTTP body / gRPC message accepted (413 beyond)."
    )
    max_code_bytes: int = Field(256 * 1024, ge=1024, le=2**26, description="Largest source file accepted.")
    max_action_bytes: int = Field(64 * 1024, ge=64, le=2**24, description="Largest single action accepted.")
    max_stdin_bytes: int = Field(2**20, ge=0, le=2**28, description="Largest stdin of an execution.")
    max_files: int = Field(32, ge=0, le=10_000, description="Most files an execution may bring.")
    max_files_bytes: int = Field(4 * 2**20, ge=0, le=2**28, description="Total bytes of an execution's files.")
    session_ttl_s: float = Field(600.0, gt=0, le=86_400, description="Idle sessions are closed after this.")
    max_sessions: int = Field(256, ge=1, le=100_000, description="Live sessions across all tenants.")
    reap_interval_s: float = Field(
        5.0, gt=0, le=3600, description="How often idle sessions are looked for (and Redis quota leases renewed)."
    )
    quotas: QuotaSettings = Field(
        default_factory=LocalQuotaSettings,
        description="Where tenant quotas are counted: 'local' (this replica) or 'redis' (shared by replicas), "
        'e.g. SPADE_SANDBOX_QUOTAS=\'{"kind": "redis", "url": "redis://redis:6379/0"}\'.',
    )
    isolation: IsolationSettings = Field(default_factory=IsolationSettings, description="Isolation layers and limits.")
    checks: CheckConfig = Field(
        default_factory=CheckConfig,
        description="Validation seed count (the seeds are drawn in secret per run), counts, thresholds.",
    )

    @field_validator("api_keys")
    @classmethod
    def _unique_keys(cls, keys: list[SandboxApiKey]) -> list[SandboxApiKey]:
        check_unique_keys(keys)
        return keys

    @model_validator(mode="after")
    def _leases_outlive_renewals(self) -> SandboxSettings:
        if isinstance(self.quotas, RedisQuotaSettings) and self.quotas.lease_s < 3 * self.reap_interval_s:
            raise ValueError(
                f"quotas.lease_s={self.quotas.lease_s} is under 3 x reap_interval_s={self.reap_interval_s}: "
                "leases would lapse between renewals; raise lease_s or lower reap_interval_s"
            )
        return self

    def unsafe_settings(self) -> list[str]:
        if not self.api_keys:
            return [
                f"no API keys configured: set {self.env_name('api_keys')} (tenants with key_sha256); "
                "without keys anyone reaching the ports runs code"
            ]
        return []

    def request_limits(self) -> RequestLimits:
        return RequestLimits(
            max_code_bytes=self.max_code_bytes,
            max_action_bytes=self.max_action_bytes,
            max_stdin_bytes=self.max_stdin_bytes,
            max_files=self.max_files,
            max_files_bytes=self.max_files_bytes,
            max_timeout_s=self.isolation.max_wall_seconds,
            max_memory_mb=self.isolation.max_memory_mb,
        )
