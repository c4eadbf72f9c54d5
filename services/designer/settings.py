"""Settings of the designer service (env prefix ``SPADE_DESIGNER_``), built once in the entry point.

Defaults fit the embedded default model, SmolLM2-135M-Instruct, whose context is 8192 tokens: a
prompt of at most 5632 tokens plus 2048 generated tokens plus a margin. For a larger model (Qwen3 in
the paper) raise ``context_tokens``, ``max_prompt_tokens``, ``max_new_tokens`` and ``doc_max_words``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from services.designer.core.loop import DesignerConfig
from services.designer.core.ports import Sampling
from spade.config import ServiceSettings
from spade.endpoints import MemoryEndpoint, SandboxEndpoint
from spade.inference.client import DEFAULT_RETRY
from spade.inference.discovery import InferenceDiscovery
from spade.queues.config import QueueConfig, RedisQueueConfig
from spade.retry import RetryPolicy


class DesignerSettings(ServiceSettings):
    """Everything the designer needs; see each field's description."""

    model_config = SettingsConfigDict(env_prefix="SPADE_DESIGNER_")
    service_name = "designer"

    setting: Literal["game", "tool"] = Field(default="game", description="Which kind of environment to design.")

    # --- the batch -------------------------------------------------------------------------------
    envs_per_batch: int = Field(default=6, ge=1, le=4096, description="Environment slots per regeneration.")
    max_attempts_per_env: int = Field(
        default=2, ge=1, le=32, description="Attempts per slot before the slot is given up (each one is a sample)."
    )
    concurrency: int = Field(default=2, ge=1, le=1024, description="Designer attempts in flight at once.")
    batch_timeout_s: float = Field(
        default=900.0, gt=0, le=86_400, description="Deadline of one batch; finished attempts are always kept."
    )
    regenerate_every: int = Field(
        default=4, ge=1, le=10_000, description="`serve`: run a new batch every this many published weight versions."
    )

    # --- generation and prompt budget --------------------------------------------------------------
    context_tokens: int = Field(default=8192, ge=512, le=1_048_576, description="The policy model's context length.")
    max_prompt_tokens: int = Field(
        default=5632, ge=256, le=1_048_576, description="Budget of the chat-templated prompt; parts shrink to fit."
    )
    max_new_tokens: int = Field(default=2048, ge=1, le=262_144, description="Most tokens generated per attempt.")
    temperature: float = Field(default=0.6, ge=0.0, le=2.0, description="Sampling temperature (0.6 as the paper).")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    doc_max_words: int = Field(
        default=600, ge=0, le=100_000, description="Corpus documents are cut to this many words (0: no document)."
    )
    doc_min_words: int = Field(
        default=100,
        ge=0,
        le=100_000,
        description="The budget halves the document down to this before dropping examples.",
    )
    n_positive: int = Field(default=2, ge=0, le=16, description="Memory positives (learnable envs) per prompt.")
    n_negative: int = Field(default=1, ge=0, le=16, description="Memory negatives (too easy / too hard) per prompt.")
    excerpt_chars: int = Field(default=1200, ge=80, le=100_000, description="Memory code excerpts are cut to this.")
    max_hint_chars: int = Field(default=2000, ge=20, le=100_000, description="Longer hints are cut to this.")

    # --- corpus ----------------------------------------------------------------------------------
    corpus_path: Path | None = Field(
        default=None,
        description="Your own JSONL corpus ('text' or 'orig_doc' per line). Default: the built-in offline corpus.",
    )
    corpus_dir: Path | None = Field(
        default=None, description="Cache of the built-in corpus (default ~/.cache/spade/corpus)."
    )
    corpus_seed: int = Field(default=0, ge=0, description="Seed of the document sampling.")

    # --- dependencies (distributed mode) ------------------------------------------------------------
    inference_urls: list[str] = Field(
        default_factory=lambda: ["http://127.0.0.1:30000"], min_length=1, description="SGLang / embedded servers."
    )
    inference_discovery: InferenceDiscovery | None = Field(
        default=None,
        description="In a cluster: follow this Service's EndpointSlices for the inference workers "
        "(inference_urls is then only the start); unset: inference_urls as given.",
    )
    tokenizer_path: Path | None = Field(
        default=None, description="Checkpoint dir holding the policy's tokenizer (default: the embedded model's)."
    )
    sandbox: SandboxEndpoint = Field(default=SandboxEndpoint(), description="The sandbox service (validation).")
    memory: MemoryEndpoint = Field(default=MemoryEndpoint(), description="The memory service.")
    queue: QueueConfig = Field(
        default_factory=RedisQueueConfig, description="Work-queue backend (its publish_timeout_s bounds a full queue)."
    )
    retry: RetryPolicy = Field(
        default=DEFAULT_RETRY, description="Tries of an inference request after a transient failure, with back-off."
    )

    @model_validator(mode="after")
    def _budget_fits_the_context(self) -> DesignerSettings:
        if self.max_prompt_tokens + self.max_new_tokens > self.context_tokens:
            raise ValueError(
                f"max_prompt_tokens ({self.max_prompt_tokens}) + max_new_tokens ({self.max_new_tokens}) exceeds "
                f"context_tokens ({self.context_tokens}): lower one of the first two or raise context_tokens"
            )
        if self.doc_min_words > self.doc_max_words:
            raise ValueError(
                f"doc_min_words ({self.doc_min_words}) exceeds doc_max_words ({self.doc_max_words}): lower it"
            )
        return self

    def unsafe_settings(self) -> list[str]:
        if self.sandbox.api_key is None:
            return [f"{self.env_name('sandbox', 'api_key')} is not set: the sandbox needs the designer's tenant key"]
        return []

    def loop_config(self) -> DesignerConfig:
        """The core loop's configuration."""
        return DesignerConfig(
            setting=self.setting,
            envs_per_batch=self.envs_per_batch,
            max_attempts_per_env=self.max_attempts_per_env,
            concurrency=self.concurrency,
            batch_timeout_s=self.batch_timeout_s,
            sampling=Sampling(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p),
            max_prompt_tokens=self.max_prompt_tokens,
            doc_max_words=self.doc_max_words,
            doc_min_words=self.doc_min_words,
            n_positive=self.n_positive,
            n_negative=self.n_negative,
            excerpt_chars=self.excerpt_chars,
            max_hint_chars=self.max_hint_chars,
            publish_timeout_s=self.queue.publish_timeout_s,
        )
