"""Settings of the memory service (environment variables prefixed ``SPADE_MEMORY_``).

Built once in the entry point (``cli.py``) and passed down. API keys are stored as SHA-256 digests
only, per tenant: ``SPADE_MEMORY_API_KEYS='[{"tenant": "ops", "key_sha256": "<hex>"}]'`` (make a key
and its digest with ``spade envs hash-token --generate``). Outside dev mode the service refuses to
start without at least one.
"""

from __future__ import annotations

from typing import Self

from pydantic import Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from services.memory.core.policy import PolicyConfig
from services.memory.core.scoring import ScoringConfig
from spade.auth import ApiKey, KeyRing, check_unique_keys
from spade.config import ServiceSettings
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
        default=ServerAddress(host="0.0.0.0", port=50052),
        description="Where the gRPC server (used by the other services, inside the private network) listens.",
    )
    http: ServerAddress = Field(
        default=ServerAddress(host="127.0.0.1", port=8082), description="Where the REST API and web page listen."
    )
    api_keys: list[ApiKey] = Field(
        default_factory=list, description="Tenants allowed to read the REST API and the web page."
    )

    window: int = Field(default=200, ge=1, le=100_000, description="Scored environments per skill the policy sees.")
    positive_low: float = Field(default=0.15, ge=0.0, le=1.0, description="Lowest win rate of a positive example.")
    positive_high: float = Field(default=0.85, ge=0.0, le=1.0, description="Highest win rate of a positive example.")
    too_easy: float = Field(default=0.9, ge=0.0, le=1.0, description="Win rates above this are 'too easy' negatives.")
    too_hard: float = Field(default=0.1, ge=0.0, le=1.0, description="Win rates below this are 'too hard' negatives.")
    pool_factor: int = Field(default=3, ge=1, le=100, description="Positive pool size is max(pool_factor*n, pool_min).")
    pool_min: int = Field(default=10, ge=1, le=10_000, description="See pool_factor.")
    excerpt_chars: int = Field(default=1200, ge=80, le=100_000, description="Longest code excerpt in an example.")
    window_versions: int = Field(default=4, ge=1, le=10_000, description="k: weight versions an environment is active.")
    win_threshold: float = Field(default=1.0, ge=0.0, le=1.0, description="Least return that counts as a win.")

    @field_validator("api_keys")
    @classmethod
    def _unique_keys(cls, keys: list[ApiKey]) -> list[ApiKey]:
        check_unique_keys(keys)
        return keys

    def unsafe_settings(self) -> list[str]:
        if not self.api_keys:
            return [
                f"no API key configured: set {self.env_name('api_keys')} to tenants with key_sha256 "
                "(`spade envs hash-token --generate`); without keys the REST API is open"
            ]
        return []

    @model_validator(mode="after")
    def _bands(self) -> Self:
        if not self.positive_low <= self.positive_high:
            raise ValueError(f"positive_low {self.positive_low} must be <= positive_high {self.positive_high}")
        if not self.too_hard <= self.too_easy:
            raise ValueError(f"too_hard {self.too_hard} must be <= too_easy {self.too_easy}")
        return self

    def policy(self) -> PolicyConfig:
        """The memory policy these settings describe."""
        return PolicyConfig(
            window=self.window,
            positive_band=(self.positive_low, self.positive_high),
            too_easy=self.too_easy,
            too_hard=self.too_hard,
            pool_factor=self.pool_factor,
            pool_min=self.pool_min,
            excerpt_chars=self.excerpt_chars,
        )

    def scoring(self) -> ScoringConfig:
        """How plays become statistics under these settings."""
        return ScoringConfig(
            window_versions=self.window_versions,
            win_threshold=self.win_threshold,
            learnable_band=(self.positive_low, self.positive_high),
        )

    def keyring(self) -> KeyRing[str]:
        """The tenants by key digest; in dev mode without keys the API is open (as ``dev``)."""
        return KeyRing({k.key_sha256: k.tenant for k in self.api_keys}, anonymous="dev" if self.dev_mode else None)
