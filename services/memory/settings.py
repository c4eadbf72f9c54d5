"""Settings of the memory service (environment variables prefixed ``SPADE_MEMORY_``).

Built once in the entry point (``cli.py``) and passed down. API keys are stored as SHA-256 digests
only, per tenant, each with a role: ``SPADE_MEMORY_API_KEYS='[{"tenant": "web", "key_sha256": "<hex>",
"role": "read"}]'`` (make a key and its digest with ``spade envs hash-token --generate``). They guard
the gRPC API (every other service's calls) and the REST API + web page alike: ``read`` may look (the
REST API, the web page, reads over gRPC), ``write`` may also store (environments, plays, stats,
windows, attempts, probes), ``admin`` may also set the run spec; a key naming no role is ``write``
(:data:`spade.auth.DEFAULT_ROLE`). Outside dev mode the service refuses to start without at least one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, field_validator
from pydantic_settings import SettingsConfigDict

from services.memory.core.policy import PolicyConfig
from spade.auth import KeyRing, Principal, Role, RoleKey, check_unique_keys
from spade.config import ServiceSettings
from spade.endpoints import SandboxEndpoint
from spade.pool_metrics import DEFAULT_WINDOW
from spade.serving.settings import ServerAddress


class MemorySettings(ServiceSettings):
    """Everything the memory service reads from its environment."""

    model_config = SettingsConfigDict(env_prefix="SPADE_MEMORY_")
    service_name = "memory"

    database_url: str = Field(
        default="sqlite:///spade-memory.db",
        min_length=1,
        description="SQLAlchemy URL: postgresql+psycopg://... (distributed) or sqlite:///file.db (embedded).",
    )
    migrate_on_start: bool = Field(default=True, description="Apply the Alembic migrations when starting.")
    grpc: ServerAddress = Field(
        default=ServerAddress(host="127.0.0.1", port=50052),
        description="Where the gRPC API (the other services' calls, keys required) listens; 0.0.0.0 to serve "
        "other hosts.",
    )
    http: ServerAddress = Field(
        default=ServerAddress(host="127.0.0.1", port=8082), description="Where the REST API and web page listen."
    )
    api_keys: list[RoleKey] = Field(
        default_factory=list,
        description="Tenants allowed to call the gRPC API and to read the REST API and the web page, each with "
        "a role: read (REST API, web page, gRPC reads), write (also store envs, plays, stats, attempts: the "
        "designer's, rollout's and learner's keys; the default) or admin (also set the run spec: the operator's).",
    )
    run_spec_file: Path | None = Field(
        default=None,
        description="A run spec (YAML/JSON of spade.runspec.RunSpec fields) to store at start when none is "
        "stored; a different stored spec refuses the start.",
    )
    session_ttl_s: float = Field(
        default=12 * 3600.0, ge=60.0, le=30 * 86400.0, description="How long a web page login lasts, in seconds."
    )

    window: int = Field(default=200, ge=1, le=100_000, description="Scored environments per skill the policy sees.")
    pool_factor: int = Field(default=3, ge=1, le=100, description="Positive pool size is max(pool_factor*n, pool_min).")
    pool_min: int = Field(default=10, ge=1, le=10_000, description="See pool_factor.")
    excerpt_chars: int = Field(default=1200, ge=80, le=100_000, description="Longest code excerpt in an example.")
    window_versions_game: int | None = Field(
        default=None,
        ge=1,
        le=1_000_000,
        description="k of game envs whose window was never set; unset: the run spec's (a different value "
        "contradicts the spec and is refused).",
    )
    window_versions_tool: int | None = Field(
        default=None,
        ge=1,
        le=1_000_000,
        description="k of tool envs whose window was never set; unset: the run spec's.",
    )
    vendi: bool = Field(
        default=True,
        description="Compute the Vendi score / n of the pool in /v1/stats (loads all-MiniLM-L6-v2 on first use).",
    )
    sandbox: SandboxEndpoint | None = Field(
        default=None,
        description="A sandbox to probe new pool envs through (first observation, hidden state, leakage); unset: "
        "only the probes other services report (RecordProbe) count.",
    )
    probe_every_s: float = Field(
        default=30.0, ge=1.0, le=3600.0, description="Seconds between two looks for unprobed pool envs."
    )
    stats_refresh_s: float = Field(
        default=5.0,
        ge=0.0,
        le=3600.0,
        description="The REST API's /v1/stats and page recompute at most this often (0: on every change).",
    )
    content_env_ids: bool = Field(
        default=False,
        description="Name each env by a hash of its normalised code instead of a random id, so a rerun of a seeded "
        "run plays the same seeds (they derive from env ids). Only for a memory that is one run's own (the embedded "
        "run sets it): queue idempotency keys derive from env ids too, so a second run on the same Redis and prefix "
        "within idempotency_ttl_s would have its plays of a shared program dropped as repeats.",
    )
    metrics_window: int = Field(
        default=DEFAULT_WINDOW,
        ge=2,
        le=10_000,
        description="Envs in the sliding window of the windowed process metrics (Vendi, learnable fraction).",
    )

    @field_validator("api_keys")
    @classmethod
    def _unique_keys(cls, keys: list[RoleKey]) -> list[RoleKey]:
        check_unique_keys(keys)
        return keys

    def unsafe_settings(self) -> list[str]:
        if not self.api_keys:
            return [
                f"no API key configured: set {self.env_name('api_keys')} to tenants with key_sha256 "
                "(`spade envs hash-token --generate`); without keys the gRPC and REST APIs are open"
            ]
        return []

    def policy(self) -> PolicyConfig:
        """The memory policy these settings describe."""
        return PolicyConfig(
            window=self.window, pool_factor=self.pool_factor, pool_min=self.pool_min, excerpt_chars=self.excerpt_chars
        )

    def spec_overlap(self) -> dict[str, Any]:
        """The settings the run spec also fixes, by spec field name (``None``: take the spec's)."""
        return {"window_versions_game": self.window_versions_game, "window_versions_tool": self.window_versions_tool}

    def window_defaults(self) -> dict[str, int]:
        """k per setting for envs whose window was never set, where configured."""
        return {k.removeprefix("window_versions_"): v for k, v in self.spec_overlap().items() if v is not None}

    def keyring(self) -> KeyRing[Principal]:
        """The tenants and their roles by key digest; in dev mode without keys the API is open (as ``dev``, admin)."""
        dev = Principal("dev", Role.ADMIN) if self.dev_mode else None
        return KeyRing({k.key_sha256: k.principal() for k in self.api_keys}, anonymous=dev)
