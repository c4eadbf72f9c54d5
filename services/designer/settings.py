"""Settings of the designer service (env prefix ``SPADE_DESIGNER_``), built once in the entry point.

Defaults fit the embedded default model, SmolLM2-135M-Instruct, whose context is 8192 tokens: a
prompt of at most 5632 tokens plus the generated answer. For a larger model (Qwen3 in the paper)
raise ``context_tokens``, ``max_prompt_tokens`` and ``doc_max_words``.

The fields that must agree across services come from the run spec (``spade.runspec.RunSpec``):
``envs_per_round``, ``skills_per_round``, ``max_new_tokens`` (the spec's
``designer_max_new_tokens``), ``temperature`` and ``top_p``. Unset (``None``) they take the spec's
value; set and different, the designer refuses to start naming each field
(:meth:`DesignerSettings.spec_problems`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_settings import SettingsConfigDict

from services.designer.core.loop import DesignerConfig
from services.designer.core.pipeline import PipelineConfig
from services.designer.core.pool import PoolConfig
from services.designer.core.ports import Sampling
from services.designer.core.prompts import AgentBudget
from services.designer.core.reachability import VERDICT_REGEX, ReachabilityConfig
from spade.config import ServiceSettings
from spade.endpoints import InferenceEndpoint, MemoryEndpoint, SandboxEndpoint
from spade.envs.types import Setting
from spade.inference.answer_format import DESIGNER_ANSWER_REGEX
from spade.inference.client import DEFAULT_RETRY
from spade.inference.discovery import InferenceDiscovery
from spade.queues.config import QueueConfig, RedisQueueConfig
from spade.retry import RetryPolicy
from spade.runspec import RunSpec


class SpecMismatch(ValueError):
    """The designer's own settings contradict the run spec (or do not fit with it); one line per problem."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


class CriteriaReachableSettings(BaseModel):
    """The ``criteria_reachable`` check of tool envs: the policy judges each criterion's reachability."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(
        default=True,
        description="Ask the policy, for each valid tool env, whether every criterion can be made true "
        "(the paper's LLM validator; unknown verdicts reject). Off in the embedded run by default.",
    )
    temperature: float = Field(default=0.3, gt=0.0, le=2.0, description="Sampling temperature of the verdict.")
    max_new_tokens: int = Field(default=1024, ge=16, le=262_144, description="Tokens of one verdict reply.")
    tries: int = Field(default=2, ge=1, le=8, description="Replies asked for before an unknown verdict is final.")


class DesignerSettings(ServiceSettings):
    """Everything the designer needs; see each field's description."""

    model_config = SettingsConfigDict(env_prefix="SPADE_DESIGNER_")
    service_name = "designer"

    setting: Setting = Field(default=Setting.GAME, description="Which kind of environment to design.")

    # --- the round (envs_per_round / skills_per_round: the run spec's unless set) -----------------
    envs_per_round: int | None = Field(
        default=None, ge=1, le=100_000, description="Environment slots per round (unset: the run spec's)."
    )
    skills_per_round: int | None = Field(
        default=None, ge=1, le=6, description="Skills of the setting's six per round (unset: the run spec's)."
    )
    max_attempts_per_env: int = Field(
        default=2, ge=1, le=32, description="Attempts per slot before the slot is given up (each one is a sample)."
    )
    attempts_at_once: int = Field(
        default=1,
        ge=1,
        le=32,
        description="A slot's attempts generated together rather than each after the previous one failed; "
        "they are still finished in order and those after the first valid one are discarded, so the samples "
        "are the same, at the cost of the discarded generations (1: the paper's one at a time).",
    )
    concurrency: int = Field(
        default=2, ge=1, le=1024, description="Designer generations in flight at once, over all slots of a round."
    )
    batch_timeout_s: float = Field(
        default=900.0, gt=0, le=86_400, description="Deadline of one round; finished attempts are always kept."
    )
    grace_s: float = Field(
        default=20.0,
        gt=0,
        le=3600,
        description="On SIGTERM, how long answers already generated may take to be validated, stored and "
        "published before the designer exits (bounds the shutdown).",
    )
    regenerate_every: int = Field(
        default=4, ge=1, le=10_000, description="`serve`: run a new round every this many published weight versions."
    )
    frozen: bool = Field(
        default=False,
        description="A frozen designer (the paper's baseline): it designs as usual, its samples are scored "
        "but marked trainable=false, so the learner never trains on them.",
    )
    pool_dir: Path | None = Field(
        default=None,
        description="Design from this directory of designer answers instead of the policy (the pool "
        "designer; `spade serve designer --pool DIR`). Its samples are scored, never trained on.",
    )

    # --- generation and prompt budget --------------------------------------------------------------
    context_tokens: int = Field(default=8192, ge=512, le=1_048_576, description="The policy model's context length.")
    max_prompt_tokens: int = Field(
        default=5632, ge=256, le=1_048_576, description="Budget of the chat-templated prompt; parts shrink to fit."
    )
    max_new_tokens: int | None = Field(
        default=None,
        ge=1,
        le=1_000_000,
        description="Most tokens generated per attempt (unset: the run spec's designer_max_new_tokens).",
    )
    temperature: float | None = Field(
        default=None, gt=0.0, le=2.0, description="Sampling temperature (unset: the run spec's; paper 0.6)."
    )
    top_p: float | None = Field(
        default=None, gt=0.0, le=1.0, description="Nucleus sampling mass (unset: the run spec's)."
    )
    structured_output: bool | None = Field(
        default=None,
        description="Constrain each answer to the answer format (SGLang's regex; one ```python block, "
        "### HINT, the hint). Unset: on for policies of at most small_model_params parameters (counted "
        "from the checkpoint's safetensors), off otherwise. Constrained samples are marked for the learner.",
    )
    small_model_params: int = Field(
        default=2_000_000_000,
        ge=0,
        le=10**13,
        description="With structured_output unset, a policy with at most this many parameters gets the "
        "answer format enforced (small models rarely follow it unconstrained).",
    )
    criteria_reachable: CriteriaReachableSettings = Field(
        default_factory=CriteriaReachableSettings,
        description="The tool setting's criteria_reachable check (SPADE_DESIGNER_CRITERIA_REACHABLE__ENABLED).",
    )
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
    inference: InferenceEndpoint = Field(
        default_factory=InferenceEndpoint,
        description="Key (one of the servers' api_keys, when they have any) and TLS for the inference servers "
        "(SPADE_DESIGNER_INFERENCE__API_KEY).",
    )
    tokenizer_path: Path | None = Field(
        default=None, description="Checkpoint dir holding the policy's tokenizer (default: the embedded model's)."
    )
    sandbox: SandboxEndpoint = Field(default=SandboxEndpoint(), description="The sandbox service (validation).")
    memory: MemoryEndpoint = Field(default=MemoryEndpoint(), description="The memory service (and the run spec).")
    spec_file: Path | None = Field(
        default=None,
        description="A run spec file (YAML/JSON of RunSpec fields): stored in the memory when none is, "
        "and it must equal the stored one otherwise. Unset: wait for `spade runspec set FILE`.",
    )
    wait_log_s: float = Field(
        default=10.0, gt=0, le=3600, description="While waiting for a dependency or the run spec, log every this often."
    )
    inference_wait_s: float = Field(
        default=600.0, gt=0, le=86_400, description="How long to wait for the inference servers at start."
    )
    queue: QueueConfig = Field(
        default_factory=RedisQueueConfig, description="Work-queue backend (its publish_timeout_s bounds a full queue)."
    )
    retry: RetryPolicy = Field(
        default=DEFAULT_RETRY, description="Tries of an inference request after a transient failure, with back-off."
    )
    record_retry: RetryPolicy = Field(
        default=RetryPolicy(attempts=8, initial_s=1.0, max_s=10.0),
        description="Tries of recording a finished attempt in the memory while the memory or its database is "
        "unavailable (restarting), with back-off: its sample is already published, so the record waits (about "
        "45 s by default) instead of being dropped from the memory's validity figures.",
    )

    @model_validator(mode="after")
    def _words_in_order(self) -> DesignerSettings:
        if self.doc_min_words > self.doc_max_words:
            raise ValueError(
                f"doc_min_words ({self.doc_min_words}) exceeds doc_max_words ({self.doc_max_words}): lower it"
            )
        if self.max_new_tokens is not None:
            self._check_budget(self.max_new_tokens)
        return self

    def _check_budget(self, max_new_tokens: int) -> None:
        if self.max_prompt_tokens + max_new_tokens > self.context_tokens:
            raise ValueError(
                f"max_prompt_tokens ({self.max_prompt_tokens}) + max_new_tokens ({max_new_tokens}) exceeds "
                f"context_tokens ({self.context_tokens}): lower one of the first two or raise context_tokens"
            )

    def unsafe_settings(self) -> list[str]:
        problems = []
        if self.sandbox.api_key is None:
            problems.append(
                f"{self.env_name('sandbox', 'api_key')} is not set: the sandbox needs the designer's tenant key"
            )
        if self.memory.api_key is None:
            problems.append(
                f"{self.env_name('memory', 'api_key')} is not set: the memory needs the designer's tenant key"
            )
        if self.queue.kind == "inprocess":
            problems.append(
                f"{self.env_name('queue', 'kind')}=inprocess: an in-process queue in a service of its own reaches "
                "no rollout or learner; use redis (set SPADE_DESIGNER_DEV_MODE=true only to try the designer alone)"
            )
        return problems

    def spec_fields(self) -> dict[str, Any]:
        """The settings that overlap the run spec, by spec field name (``None``: take the spec's)."""
        return {
            "envs_per_round": self.envs_per_round,
            "skills_per_round": self.skills_per_round,
            "designer_max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
        }

    def spec_problems(self, spec: RunSpec) -> list[str]:
        """Why these settings cannot run under ``spec``: each contradicting field, and a budget that
        does not fit the context with the spec's answer length. Empty when they agree."""
        problems = [f"{self._env_of(line)}{line}" for line in spec.contradictions(self.spec_fields())]
        try:
            self._check_budget(spec.designer_max_new_tokens)
        except ValueError as error:
            problems.append(f"{error} (max_new_tokens is the run spec's designer_max_new_tokens)")
        return problems

    def _env_of(self, line: str) -> str:
        field = line.split(":", 1)[0]
        own = {"designer_max_new_tokens": "max_new_tokens"}.get(field, field)
        return f"{self.env_name(own)}: " if own in type(self).model_fields else ""

    def check_spec(self, spec: RunSpec) -> None:
        """Refuse to run under ``spec`` when :meth:`spec_problems` finds any.

        Raises:
            SpecMismatch: One problem per field, naming its variable, its value and the spec's.
        """
        problems = self.spec_problems(spec)
        if problems:
            raise SpecMismatch(problems)

    def _sampling(self, spec: RunSpec, regex: str | None) -> Sampling:
        return Sampling(
            max_new_tokens=spec.designer_max_new_tokens,
            temperature=spec.temperature,
            top_p=spec.top_p,
            regex=regex,
        )

    def loop_config(self, spec: RunSpec, *, structured: bool) -> DesignerConfig:
        """The policy designer's configuration under ``spec`` (call :meth:`check_spec` first).

        Args:
            spec: The run spec.
            structured: Whether answers are constrained to the answer format.
        """
        return DesignerConfig(
            setting=self.setting,
            envs_per_round=spec.envs_per_round,
            skills_per_round=spec.skills_per_round,
            max_attempts_per_env=self.max_attempts_per_env,
            attempts_at_once=self.attempts_at_once,
            concurrency=self.concurrency,
            batch_timeout_s=self.batch_timeout_s,
            grace_s=self.grace_s,
            sampling=self._sampling(spec, DESIGNER_ANSWER_REGEX if structured else None),
            budget=AgentBudget(max_turns=spec.agent_max_turns, max_tokens_per_turn=spec.agent_max_tokens_per_turn),
            spec_id=spec.spec_id,
            trainable=not self.frozen,
            max_prompt_tokens=self.max_prompt_tokens,
            doc_max_words=self.doc_max_words,
            doc_min_words=self.doc_min_words,
            n_positive=self.n_positive,
            n_negative=self.n_negative,
            excerpt_chars=self.excerpt_chars,
        )

    def pipeline_config(self, spec: RunSpec) -> PipelineConfig:
        """The answer pipeline's configuration under ``spec``."""
        return PipelineConfig(
            setting=self.setting,
            spec_id=spec.spec_id,
            agent_max_turns=spec.agent_max_turns,
            max_hint_chars=self.max_hint_chars,
            max_new_tokens=spec.designer_max_new_tokens,
            publish_timeout_s=self.queue.publish_timeout_s,
        )

    def pool_config(self, spec: RunSpec) -> PoolConfig:
        """The pool designer's configuration under ``spec``."""
        return PoolConfig(
            setting=self.setting,
            envs_per_round=spec.envs_per_round,
            skills_per_round=spec.skills_per_round,
            concurrency=self.concurrency,
            batch_timeout_s=self.batch_timeout_s,
            grace_s=self.grace_s,
            spec_id=spec.spec_id,
        )

    def reachability_config(self, *, structured: bool) -> ReachabilityConfig:
        """The ``criteria_reachable`` check's configuration."""
        judge = self.criteria_reachable
        return ReachabilityConfig(
            sampling=Sampling(
                max_new_tokens=judge.max_new_tokens,
                temperature=judge.temperature,
                regex=VERDICT_REGEX if structured else None,
            ),
            tries=judge.tries,
            max_prompt_tokens=self.max_prompt_tokens,
        )
