"""Builds the designer's object graph from ``DesignerSettings`` and the run spec: the one place
adapters meet the core.

Embedded mode (``spade run``) passes its own in-process parts and its run spec to
``build_designer`` (the policy's designer) or ``build_pool_designer`` (answers from a directory);
distributed mode (``spade serve designer``) uses ``designer_service``, which reads the run spec from
the memory and connects to the inference servers, the sandbox and the memory over the network and
to the configured queue backend.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

from services.designer.core.loop import Designer
from services.designer.core.pipeline import AttemptPipeline, SeedDeriver
from services.designer.core.pool import DesignerPool
from services.designer.core.ports import EnvironmentMemory, PolicyLLM, Validator
from services.designer.core.prompts import ExampleEnv
from services.designer.core.reachability import CriteriaReachable
from services.designer.corpus.builder import ensure_default_corpus
from services.designer.corpus.loader import Corpus, CorpusSampler, load_jsonl
from services.designer.model_size import StructuredDecision, decide_structured_output
from services.designer.outbox import QueueOutbox
from services.designer.pool_files import load_pool
from services.designer.settings import DesignerSettings
from spade.envs.types import Setting
from spade.queues.base import WorkQueue
from spade.runspec import RunSpec
from spade.serving.logs import get_logger

log = get_logger(__name__)


def load_corpus(settings: DesignerSettings) -> Corpus:
    """The user's JSONL corpus, or the built-in one of the setting (built on first use)."""
    path = settings.corpus_path or ensure_default_corpus(settings.setting, settings.corpus_dir)
    corpus = load_jsonl(path)
    log.info("corpus %s: %d documents (%d lines skipped)", path, len(corpus), corpus.skipped)
    return corpus


def load_examples(setting: str) -> list[ExampleEnv]:
    """The contract library's example environments of ``setting``, with their hints."""
    from spade.envs.examples import EXAMPLES

    found = []
    for name, example in sorted(EXAMPLES.items()):
        if str(example.setting) != setting:
            continue
        found.append(ExampleEnv(name=name, code=example.code, hint=example.hint))
    if not found:
        raise RuntimeError(f"spade.envs.examples has no {setting} example: the designer prompt needs one")
    return found


def repair(code: str) -> str:
    """The contract library's known repairs (before the sandbox, which repairs again)."""
    from spade.envs.repair import repair_code

    repaired, _applied = repair_code(code)
    return repaired


def designer_seeds(run: str) -> SeedDeriver:
    """Sampling seeds of the designer's generations from (run, round, slot, attempt) (WAVE2 §7).

    One derivation for the whole system (``spade.inference.derive_sampling_seed``); the designer's
    coordinates map onto it as env ``designer/<purpose>``, version = round, seed = slot, arm =
    ``attempt-<n>``, turn = the try within the attempt, so they never meet an agent play's seeds.
    """
    from spade.inference.seeds import derive_sampling_seed

    def seed(round_index: int, slot: int, attempt: int, purpose: str, turn: int) -> int:
        return derive_sampling_seed(run, f"designer/{purpose}", round_index, slot, f"attempt-{attempt}", turn)

    return seed


def structured_output(settings: DesignerSettings) -> StructuredDecision:
    """Whether the policy's answers are constrained to the answer format, and why."""
    from spade.inference.models import resolve_model_path

    if settings.structured_output is not None:
        return decide_structured_output(settings.structured_output, Path("."), settings.small_model_params)
    checkpoint = resolve_model_path(settings.tokenizer_path)
    return decide_structured_output(None, checkpoint, settings.small_model_params)


def build_pipeline(
    settings: DesignerSettings,
    *,
    spec: RunSpec,
    validator: Validator,
    memory: EnvironmentMemory,
    queue: WorkQueue,
    llm: PolicyLLM | None,
    structured: bool,
) -> AttemptPipeline:
    """The answer pipeline (shared by the policy's and the pool's designer).

    ``criteria_reachable`` runs for tool envs when enabled and a policy is given; otherwise the
    designer says at start that it does not.
    """
    reachability = None
    if settings.setting == Setting.TOOL and settings.criteria_reachable.enabled:
        if llm is None:
            log.warning("criteria_reachable is enabled but no policy is reachable: tool envs are not judged")
        else:
            reachability = CriteriaReachable(llm, settings.reachability_config(structured=structured))
    return AttemptPipeline(
        settings.pipeline_config(spec),
        validator=validator,
        memory=memory,
        outbox=QueueOutbox(queue),
        repair=repair,
        reachability=reachability,
        seeds=designer_seeds(spec.spec_id),
    )


def build_designer(
    settings: DesignerSettings,
    *,
    spec: RunSpec,
    llm: PolicyLLM,
    validator: Validator,
    memory: EnvironmentMemory,
    queue: WorkQueue,
    corpus: Corpus | None = None,
    examples: list[ExampleEnv] | None = None,
    structured: bool | None = None,
) -> Designer:
    """The policy's designer over the given dependencies, under the run spec.

    Args:
        settings: The designer's settings (``frozen`` makes its samples untrainable).
        spec: The run spec (rounds, the designer's token budget, sampling, the agent's budget).
        llm: The policy.
        validator: The sandbox validation pipeline.
        memory: The environment memory.
        queue: Where its results go (``envs.ready``, ``samples.designer``).
        corpus: The corpus (default: ``settings.corpus_path`` or the built-in one).
        examples: The example envs of the prompt (default: the contract's).
        structured: Constrain answers to the answer format (default: ``settings.structured_output``,
            unset: by the policy's size; see ``services/designer/model_size.py``).

    Raises:
        SpecMismatch: The settings contradict the spec (each field named).
    """
    settings.check_spec(spec)
    if structured is None:
        decision = structured_output(settings)
        structured = decision.enabled
        log.info("structured output %s: %s", "on" if structured else "off", decision.reason)
    corpus = corpus if corpus is not None else load_corpus(settings)
    pipeline = build_pipeline(
        settings, spec=spec, validator=validator, memory=memory, queue=queue, llm=llm, structured=structured
    )
    return Designer(
        settings.loop_config(spec, structured=structured),
        llm=llm,
        pipeline=pipeline,
        memory=memory,
        documents=CorpusSampler(corpus, seed=settings.corpus_seed),
        examples=examples if examples is not None else load_examples(settings.setting),
        seeds=designer_seeds(spec.spec_id),
    )


def build_pool_designer(
    settings: DesignerSettings,
    directory: Path,
    *,
    spec: RunSpec,
    validator: Validator,
    memory: EnvironmentMemory,
    queue: WorkQueue,
    llm: PolicyLLM | None = None,
    structured: bool = False,
) -> DesignerPool:
    """The pool designer: answers from ``directory`` through the real pipeline, scored, never trained.

    ``spade run --designer-pool DIR`` and ``spade serve designer --pool DIR`` build it here.

    Args:
        settings: The designer's settings (setting, concurrency, deadlines; ``criteria_reachable``).
        directory: The answer files (see ``services/designer/pool_files.py``).
        spec: The run spec (rounds, the agent's budget).
        validator: The sandbox validation pipeline.
        memory: The environment memory.
        queue: Where its results go.
        llm: The policy, only for ``criteria_reachable`` on tool envs (``None``: not judged).
        structured: Constrain the judge's verdict to its line format.

    Raises:
        SpecMismatch: The settings contradict the spec.
        ValueError: The directory holds no answer, or an answer names an unknown skill.
    """
    settings.check_spec(spec)
    answers = load_pool(directory)
    pipeline = build_pipeline(
        settings, spec=spec, validator=validator, memory=memory, queue=queue, llm=llm, structured=structured
    )
    pool = DesignerPool(settings.pool_config(spec), answers, pipeline=pipeline)
    log.info("designer pool %s: %d answers, %d per round", directory, len(answers), spec.envs_per_round)
    return pool


@dataclass
class DesignerRuntime:
    """A connected designer and what it needs to run (``spade serve designer``).

    Attributes:
        designer: The policy's designer, or the pool designer (``pool_dir``).
        queue: The work queues.
        settings: The service settings.
        spec: The run spec it runs under.
        initial_version: The policy version the inference servers served at start.
    """

    designer: Designer | DesignerPool
    queue: WorkQueue
    settings: DesignerSettings
    spec: RunSpec
    initial_version: int = 0


@contextlib.asynccontextmanager
async def designer_service(
    settings: DesignerSettings,
    *,
    stop: asyncio.Event | None = None,
    memory_factory: Callable[[str], object] | None = None,
) -> AsyncIterator[DesignerRuntime]:
    """Read the run spec, connect to inference, sandbox, memory and queues; close everything on exit.

    Every wait logs what it waits for every ``wait_log_s`` and ends at once when ``stop`` is set.

    Args:
        settings: The service settings.
        stop: Set on SIGTERM: a wait at start then raises ``StoppedWhileWaiting``.
        memory_factory: Builds the memory client from ``settings.memory.target`` (default: the
            memory service's gRPC client, ``spade.memory.client.MemoryClient``).

    Raises:
        SpecMismatch: The settings contradict the stored run spec.
        ConfigError: The spec file is unreadable or not a valid spec.
        RunSpecConflict: The spec file differs from the stored spec.
        StoppedWhileWaiting: ``stop`` was set while starting.
    """
    from services.designer.adapters import (
        InferencePolicy,
        MemoryServiceEnvironments,
        SandboxServiceValidator,
        parse_weight_version,
    )
    from services.designer.startup import run_spec_from_memory
    from spade.inference.client import InferenceClient
    from spade.inference.discovery import following
    from spade.inference.models import resolve_model_path
    from spade.memory.runspec import load_spec_file
    from spade.queues.factory import make_queue
    from spade.sandbox.client import SandboxClient
    from spade.serving.startup import logged_wait

    given = load_spec_file(settings.spec_file) if settings.spec_file is not None else None
    if memory_factory is None:
        from spade.memory.client import MemoryClient

        def memory_factory(target: str) -> object:
            return MemoryClient.from_endpoint(settings.memory)

    memory_client = memory_factory(settings.memory.target)
    stack = contextlib.AsyncExitStack()
    async with stack:
        stack.push_async_callback(_close, memory_client)
        spec = await run_spec_from_memory(
            memory_client,  # type: ignore[arg-type]
            given=given,
            stop=stop,
            every_s=settings.wait_log_s,
        )
        settings.check_spec(spec)
        queue = make_queue(settings.queue)
        stack.push_async_callback(queue.close)
        endpoint = settings.sandbox
        sandbox = SandboxClient.from_endpoint(endpoint)
        stack.push_async_callback(sandbox.close)
        validator = SandboxServiceValidator(sandbox)
        memory = MemoryServiceEnvironments(memory_client, record_retry=settings.record_retry)  # type: ignore[arg-type]
        pool_needs_llm = settings.setting == Setting.TOOL and settings.criteria_reachable.enabled
        llm = None
        initial_version = 0
        if settings.pool_dir is None or pool_needs_llm:
            tokenizer = resolve_model_path(settings.tokenizer_path)
            client = InferenceClient(
                settings.inference_urls,
                tokenizer_path=tokenizer,
                retry=settings.retry,
                api_key=settings.inference.key(),
                tls=settings.inference.tls,
            )
            stack.push_async_callback(client.aclose)
            urls = ", ".join(settings.inference_urls)
            await logged_wait(
                f"the inference servers ({urls}) to answer /health_generate",
                client.wait_ready(timeout_s=settings.inference_wait_s),
                stop=stop,
                every_s=settings.wait_log_s,
                service="designer",
            )
            infos = await client.model_info()
            initial_version = min((parse_weight_version(i.weight_version) for i in infos), default=0)
            llm = InferencePolicy(client)
            await stack.enter_async_context(following(settings.inference_discovery, client.set_urls))
        designer: Designer | DesignerPool
        if settings.pool_dir is not None:
            designer = build_pool_designer(
                settings, settings.pool_dir, spec=spec, validator=validator, memory=memory, queue=queue, llm=llm
            )
        else:
            assert llm is not None
            designer = build_designer(settings, spec=spec, llm=llm, validator=validator, memory=memory, queue=queue)
        yield DesignerRuntime(
            designer=designer, queue=queue, settings=settings, spec=spec, initial_version=initial_version
        )


async def _close(client: object) -> None:
    close = getattr(client, "close", None)
    if close is not None:
        result = close()
        if hasattr(result, "__await__"):
            await result
