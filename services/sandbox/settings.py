"""Typed settings of the sandbox service, built once in the entry point.

Environment variables use the prefix ``SPADE_SANDBOX_`` and ``__`` for nesting, e.g.
``SPADE_SANDBOX_HTTP_PORT=8081``, ``SPADE_SANDBOX_ISOLATION__CPU_SECONDS=10``,
``SPADE_SANDBOX_API_KEYS='[{"tenant": "rl", "key_sha256": "<hex>"}]'``. A YAML/JSON file can be
given with ``spade serve sandbox --config FILE``; values from the file win over the environment.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.sandbox.core.requests import RequestLimits
from services.sandbox.isolation import IsolationSettings
from spade.envs import CheckConfig


class ApiKey(BaseModel):
    """One tenant's key (stored as a SHA-256 hex digest, never in clear) and its quotas."""

    tenant: str = Field(min_length=1, max_length=64, description="Tenant name, shown in errors and metrics.")
    key_sha256: str = Field(
        pattern=r"^[0-9a-fA-F]{64}$",
        description="Hex SHA-256 of the API key (see `spade.cli` docs: sha256sum of the key).",
    )
    max_sessions: int = Field(16, ge=1, le=10_000, description="Concurrent sessions this tenant may hold.")
    executions_per_minute: int = Field(
        120, ge=1, le=1_000_000, description="Executions and validations per rolling minute."
    )


class SandboxSettings(BaseSettings):
    """Settings of ``spade serve sandbox`` (and of the embedded sandbox pool)."""

    model_config = SettingsConfigDict(env_prefix="SPADE_SANDBOX_", env_nested_delimiter="__", extra="forbid")

    dev_mode: bool = Field(
        False, description="Allow unsafe defaults (no API keys: anonymous access). Never in production."
    )
    host: str = Field("127.0.0.1", description="Interface both servers bind.")
    grpc_port: int = Field(50051, ge=0, le=65535, description="gRPC port (0 picks a free one).")
    http_port: int = Field(8081, ge=0, le=65535, description="REST port (0 picks a free one).")
    api_keys: list[ApiKey] = Field(default_factory=list, description="Tenants allowed to call the service.")
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
    reap_interval_s: float = Field(5.0, gt=0, le=3600, description="How often idle sessions are looked for.")
    isolation: IsolationSettings = Field(default_factory=IsolationSettings, description="Isolation layers and limits.")
    checks: CheckConfig = Field(default_factory=CheckConfig, description="Validation seeds, counts, thresholds.")

    @field_validator("api_keys")
    @classmethod
    def _unique_keys(cls, keys: list[ApiKey]) -> list[ApiKey]:
        digests = [k.key_sha256.lower() for k in keys]
        if len(set(digests)) != len(digests):
            raise ValueError("two tenants share one API key hash: give each tenant its own key")
        return keys

    @model_validator(mode="after")
    def _refuse_unsafe(self) -> SandboxSettings:
        if not self.dev_mode and not self.api_keys:
            raise ValueError(
                "no API keys configured: set SPADE_SANDBOX_API_KEYS (tenants with key_sha256), "
                "or SPADE_SANDBOX_DEV_MODE=true for anonymous local use"
            )
        return self

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


def load_settings(config_file: Path | None = None, **overrides: Any) -> SandboxSettings:
    """Build the settings from an optional YAML/JSON file, the environment and explicit overrides."""
    data: dict[str, Any] = {}
    if config_file is not None:
        loaded = yaml.safe_load(config_file.read_text())
        if loaded is not None and not isinstance(loaded, dict):
            raise ValueError(f"{config_file}: expected a mapping of settings, got {type(loaded).__name__}")
        data.update(loaded or {})
    data.update(overrides)
    return SandboxSettings(**data)
