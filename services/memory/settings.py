"""Settings of the memory service (environment variables prefixed ``SPADE_MEMORY_``).

Built once in the entry point (``cli.py``) and passed down. API tokens are stored as SHA-256 hashes
only: generate one with ``spade envs hash-token`` and put the hash in ``SPADE_MEMORY_API_TOKEN_SHA256``
(a JSON list). Outside dev mode the service refuses to start without at least one.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from typing import Self

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.memory.core.policy import PolicyConfig
from services.memory.core.scoring import ScoringConfig

_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def hash_token(token: str) -> str:
    """SHA-256 hex digest of an API token (what the settings store)."""
    return hashlib.sha256(token.encode()).hexdigest()


class MemorySettings(BaseSettings):
    """Everything the memory service reads from its environment."""

    model_config = SettingsConfigDict(env_prefix="SPADE_MEMORY_", extra="forbid")

    dev_mode: bool = Field(
        default=False, description="Allow unsafe defaults (no API token: the REST API is open). Never in production."
    )
    database_url: str = Field(
        default="sqlite:///spade-memory.db",
        min_length=1,
        description="SQLAlchemy URL: postgresql+psycopg://... (distributed) or sqlite:///file.db (embedded).",
    )
    migrate_on_start: bool = Field(default=True, description="Apply the Alembic migrations when starting.")
    grpc_host: str = Field(default="0.0.0.0", description="Interface of the gRPC server.")
    grpc_port: int = Field(default=50052, ge=0, le=65535, description="gRPC port (0: any free port).")
    rest_host: str = Field(default="127.0.0.1", description="Interface of the REST API and web page.")
    rest_port: int = Field(default=8082, ge=0, le=65535, description="REST port.")
    api_token_sha256: list[str] = Field(
        default_factory=list,
        description="SHA-256 hex digests of the accepted bearer tokens (see `spade envs hash-token`).",
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

    @field_validator("api_token_sha256")
    @classmethod
    def _hashes_only(cls, v: list[str]) -> list[str]:
        for h in v:
            if not _SHA256.match(h):
                raise ValueError(
                    "api_token_sha256 holds SHA-256 hex digests, not tokens: hash a token with "
                    "`spade envs hash-token` and store the 64-character result"
                )
        return v

    @model_validator(mode="after")
    def _safe_outside_dev_mode(self) -> Self:
        if not self.dev_mode and not self.api_token_sha256:
            raise ValueError(
                "no API token configured: set SPADE_MEMORY_API_TOKEN_SHA256 to a JSON list of token hashes "
                "(`spade envs hash-token`), or SPADE_MEMORY_DEV_MODE=1 for an open local API"
            )
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

    def token_ok(self, token: str) -> bool:
        """Whether ``token`` is accepted (constant-time per configured hash). Open in dev mode without tokens."""
        if not self.api_token_sha256:
            return self.dev_mode
        digest = hash_token(token)
        return any(hmac.compare_digest(digest, h) for h in self.api_token_sha256)
