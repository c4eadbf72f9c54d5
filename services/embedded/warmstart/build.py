"""One warm start from scratch: pairs, the base model's evaluation, SFT, the warm model's evaluation.

``build`` writes the checkpoint into a staging directory and returns the record ``cache.py`` stores
as ``warmstart.json``; ``cache.ensure_warm_start`` is the entry point. The sandbox pool (validation
of the pairs and of the evaluated answers) runs for the whole build; the inference server runs only
while a model is evaluated, and training runs in a worker thread so the pool's event loop stays live.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.designer.core.prompts import AgentBudget
from services.embedded.warmstart.data import PairConfig, PairSet, Validate, build_pairs, code_digest, split_documents
from services.embedded.warmstart.evaluate import GenerationConfig, eval_prompts, evaluate
from services.embedded.warmstart.settings import WarmStartSettings
from spade import openmp
from spade.serving.logs import get_logger

if TYPE_CHECKING:
    from services.designer.core.prompts import ExampleEnv
    from services.designer.corpus.loader import Document
    from spade.envs.families import FamilyEnv
    from spade.inference.chat import ChatFormatter

log = get_logger(__name__)

Progress = Callable[[str, float, float], None]

#: Probe pairs (held-out documents, training families) whose answer loss is measured before and after.
LOSS_PROBE_PAIRS = 4


class PhaseClock:
    """Wall and CPU seconds (this process: training, the inference server's thread) per phase.

    On a busy machine the wall time says little about the warm start itself; the CPU time does.
    """

    def __init__(self) -> None:
        self._start = self._mark = (time.perf_counter(), time.process_time())
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}

    def lap(self, phase: str) -> None:
        now = (time.perf_counter(), time.process_time())
        self.wall[phase] = now[0] - self._mark[0]
        self.cpu[phase] = now[1] - self._mark[1]
        self._mark = now

    def totals(self) -> tuple[dict[str, float], dict[str, float]]:
        """Per phase and ``total`` (from the clock's start, setup included), rounded to 0.1 s."""
        now = (time.perf_counter(), time.process_time())
        wall = {**self.wall, "total": now[0] - self._start[0]}
        cpu = {**self.cpu, "total": now[1] - self._start[1]}
        return {k: round(v, 1) for k, v in wall.items()}, {k: round(v, 1) for k, v in cpu.items()}


class WarmStartError(RuntimeError):
    """The warm start cannot be built as configured (the message names the cause and the fix)."""


@dataclass(frozen=True)
class Material:
    """What pairs and held-out prompts are made of."""

    base: Path
    formatter: ChatFormatter
    config: PairConfig
    training_documents: list[Document]
    held_out_documents: list[Document]
    examples: list[ExampleEnv]
    memory_pool: list[FamilyEnv]


def pair_config(settings: WarmStartSettings) -> PairConfig:
    """The pairs' settings of a warm start."""
    return PairConfig(
        setting=settings.setting,
        count=settings.pairs,
        seed=settings.seed,
        max_prompt_tokens=settings.max_prompt_tokens,
        max_answer_tokens=settings.max_answer_tokens,
        doc_max_words=settings.doc_max_words,
        doc_min_words=settings.doc_min_words,
        memory_examples=settings.memory_examples,
        budget=AgentBudget(settings.agent_max_turns, settings.agent_max_tokens_per_turn),
    )


def material(settings: WarmStartSettings) -> Material:
    """The base model's chat template, the corpus split, the designer's example envs, the memory pool."""
    from services.designer.corpus.loader import load_jsonl
    from services.designer.wiring import load_examples
    from services.embedded.warmstart.cache import corpus_file
    from spade.envs.families import seed_pool_envs
    from spade.inference.chat import ChatFormatter
    from spade.inference.models import resolve_model_path

    base = resolve_model_path(settings.model_path)
    train_docs, held_docs = split_documents(
        load_jsonl(corpus_file(settings)), settings.held_out_documents, settings.seed
    )
    return Material(
        base=base,
        formatter=ChatFormatter.from_pretrained(base),
        config=pair_config(settings),
        training_documents=train_docs,
        held_out_documents=held_docs,
        examples=load_examples(settings.setting),
        memory_pool=seed_pool_envs(settings.setting),
    )


@contextlib.asynccontextmanager
async def sandbox(settings: WarmStartSettings) -> AsyncIterator[Validate]:
    """The real sandbox pool, as a validation of one program within the agent's turn budget."""
    from services.designer.adapters import checks_within
    from services.sandbox.isolation import SandboxPool

    checks = checks_within(settings.checks, settings.agent_max_turns)
    async with SandboxPool(settings.isolation) as pool:

        async def validate(code: str) -> Any:
            return await pool.validate(code, settings.setting, checks)

        yield validate


async def pairs_for(
    settings: WarmStartSettings, stuff: Material, validate: Validate, progress: Progress | None, *, probe: bool = False
) -> PairSet:
    """The training pairs (or, with ``probe``, a few pairs on held-out documents for the loss probe)."""
    from spade.envs.families import training_families

    config = stuff.config
    documents = stuff.training_documents
    if probe:
        config = replace(config, count=LOSS_PROBE_PAIRS, seed=config.seed + 1)
        documents = stuff.held_out_documents
    return await build_pairs(
        config,
        tokenize=stuff.formatter.apply,
        tokenizer=stuff.formatter.tokenizer,
        validate=validate,
        families=training_families(settings.setting),
        documents=documents,
        examples=stuff.examples,
        memory_pool=stuff.memory_pool,
        concurrency=max(1, settings.isolation.max_concurrency),
        progress=progress,
    )


def generation_config(settings: WarmStartSettings) -> GenerationConfig:
    """The evaluation's sampling: the run's answer budget, temperature and answer-format constraint."""
    return GenerationConfig(
        max_new_tokens=settings.max_answer_tokens,
        temperature=settings.temperature,
        top_p=settings.top_p,
        structured=settings.structured,
        torch_threads=settings.torch_threads,
    )


async def evaluate_one(
    settings: WarmStartSettings,
    stuff: Material,
    model_dir: Path,
    validate: Validate,
    training_digests: frozenset[str],
    progress: Progress,
    phase: str,
) -> dict[str, Any]:
    """The evaluation of one checkpoint on the warm start's held-out prompts."""
    from spade.envs.families import held_out_families, training_families

    prompts = eval_prompts(
        stuff.config,
        count=settings.eval_prompts,
        tokenize=stuff.formatter.apply,
        documents=stuff.held_out_documents,
        training_families=training_families(settings.setting),
        held_out_families=held_out_families(settings.setting),
        examples=stuff.examples,
        memory_pool=stuff.memory_pool,
    )
    result = await evaluate(
        model_dir,
        prompts,
        validate=validate,
        generation=generation_config(settings),
        training_digests=training_digests,
        progress=progress,
        phase=phase,
    )
    # The warm start is evaluated in its staging directory: name the models by role, not by path.
    model = "base" if model_dir == stuff.base else "warm start"
    return {**result.summary(), "model": model, "answers": [a.__dict__ for a in result.answers]}


async def evaluate_pair(
    settings: WarmStartSettings, warm_dir: Path, training_digests: frozenset[str], progress: Progress
) -> dict[str, Any]:
    """The base model's and the warm start's evaluation (for a cached warm start without one)."""
    stuff = material(settings)
    async with sandbox(settings) as validate:
        before = await evaluate_one(settings, stuff, stuff.base, validate, training_digests, progress, "eval base")
        after = await evaluate_one(settings, stuff, warm_dir, validate, training_digests, progress, "eval warm")
    return {"before": before, "after": after}


def _train_and_save(
    settings: WarmStartSettings, stuff: Material, pairs: PairSet, probe: PairSet, staging: Path, progress: Progress
) -> dict[str, Any]:
    import torch

    from services.embedded.warmstart.train import (
        SFTConfig,
        answer_loss,
        load_for_training,
        save_checkpoint,
        seed_everything,
        train,
        training_sequence,
    )

    if settings.torch_threads is not None:
        torch.set_num_threads(settings.torch_threads)
    seed_everything(settings.seed)
    model, tokenizer = load_for_training(stuff.base)
    sequences = [training_sequence(p.prompt_ids, p.answer_ids) for p in pairs.pairs]
    probes = [training_sequence(p.prompt_ids, p.answer_ids) for p in probe.pairs]
    progress("loss", 0, 2 * len(probes))
    before = answer_loss(model, probes) if probes else None
    progress("loss", len(probes), 2 * len(probes))
    config = SFTConfig(
        epochs=settings.epochs,
        lr=settings.lr,
        batch_size=settings.batch_size,
        weight_decay=settings.weight_decay,
        grad_clip=settings.grad_clip,
        warmup_steps=settings.warmup_steps,
        prompt_gradient=settings.prompt_gradient,
        seed=settings.seed,
        cpu_bf16=settings.cpu_bf16,
    )
    result = train(model, sequences, config, progress=progress)
    after = answer_loss(model, probes) if probes else None
    progress("loss", 2 * len(probes), 2 * len(probes))
    save_checkpoint(model, tokenizer, staging)
    return {
        "sft": result.to_dict(),
        "loss": {
            "probe_pairs": len(probes),
            "probe_before": before,
            "probe_after": after,
            "train_first_epoch": result.epoch_loss(0),
            "train_last_epoch": result.epoch_loss(result.epochs - 1),
        },
    }


async def build(settings: WarmStartSettings, staging: Path, progress: Progress) -> dict[str, Any]:
    """Build the warm start of ``settings`` into ``staging``; return its record.

    Raises:
        WarmStartError: No pair passed validation.
    """
    clock = PhaseClock()
    stuff = material(settings)
    record: dict[str, Any] = {
        "base_model": str(stuff.base),
        "settings": settings.key_fields(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    async with sandbox(settings) as validate:
        pairs = await pairs_for(settings, stuff, validate, progress)
        probe = await pairs_for(settings, stuff, validate, None, probe=True)
        clock.lap("pairs")
        record["pairs"] = pairs.summary()
        if not pairs.pairs:
            raise WarmStartError(
                f"none of the {pairs.planned} planned pairs passed validation ({dict(pairs.invalid)} invalid, "
                f"{pairs.too_long} over the answer budget of {settings.max_answer_tokens} tokens): check the "
                "families against the validation limits and the agent's turn budget"
            )
        digests = frozenset(code_digest(p.env.code) for p in pairs.pairs)
        record["training_digests"] = sorted(digests)
        evaluation: dict[str, Any] = {}
        if settings.evaluate and settings.eval_base:
            evaluation["before"] = await evaluate_one(
                settings, stuff, stuff.base, validate, digests, progress, "eval base"
            )
            clock.lap("eval_base")
        # This executor thread may serve the run's engine or learner next: it gives its OpenMP pool back.
        trained = await asyncio.to_thread(
            openmp.then_release, _train_and_save, settings, stuff, pairs, probe, staging, progress
        )
        record.update(trained)
        clock.lap("train")
        if settings.evaluate:
            evaluation["after"] = await evaluate_one(settings, stuff, staging, validate, digests, progress, "eval warm")
            clock.lap("eval_warm")
    record["evaluation"] = evaluation or None
    record["wall_s"], record["cpu_s"] = clock.totals()
    return record
