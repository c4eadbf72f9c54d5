"""Builds the designer's object graph from ``DesignerSettings``: the one place adapters meet the core.

Embedded mode (``spade run``) passes its own in-process parts to ``build_designer``; distributed
mode (``spade serve designer``) uses ``designer_service``, which connects to the inference servers,
the sandbox and memory over the network and to the configured queue backend.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from services.designer.core.loop import Designer
from services.designer.core.ports import EnvironmentMemory, PolicyLLM, Validator
from services.designer.core.prompts import ExampleEnv
from services.designer.corpus.builder import ensure_default_corpus
from services.designer.corpus.loader import Corpus, CorpusSampler, load_jsonl
from services.designer.outbox import QueueOutbox
from services.designer.settings import DesignerSettings
from spade.queues.base import WorkQueue

log = logging.getLogger("spade.designer")


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


def build_designer(
    settings: DesignerSettings,
    *,
    llm: PolicyLLM,
    validator: Validator,
    memory: EnvironmentMemory,
    queue: WorkQueue,
    corpus: Corpus | None = None,
    examples: list[ExampleEnv] | None = None,
) -> Designer:
    """The designer loop over the given dependencies (corpus and examples loaded when not given).

    Its results go to ``queue`` through a ``QueueOutbox``.
    """
    corpus = corpus if corpus is not None else load_corpus(settings)
    return Designer(
        settings.loop_config(),
        llm=llm,
        validator=validator,
        memory=memory,
        outbox=QueueOutbox(queue),
        documents=CorpusSampler(corpus, seed=settings.corpus_seed),
        examples=examples if examples is not None else load_examples(settings.setting),
        repair=repair,
    )


@dataclass
class DesignerRuntime:
    """A connected designer and what it needs to run (``spade serve designer``)."""

    designer: Designer
    queue: WorkQueue
    settings: DesignerSettings


@contextlib.asynccontextmanager
async def designer_service(
    settings: DesignerSettings, *, memory_factory: Callable[[str], object] | None = None
) -> AsyncIterator[DesignerRuntime]:
    """Connect to inference, sandbox, memory and queues; close everything on exit.

    Args:
        settings: The service settings.
        memory_factory: Builds the memory client from ``settings.memory.target`` (default: the
            memory service's gRPC client, ``spade.memory.client.MemoryClient``).
    """
    from services.designer.adapters import InferencePolicy, MemoryServiceEnvironments, SandboxServiceValidator
    from spade.inference.client import InferenceClient
    from spade.inference.discovery import following
    from spade.inference.models import resolve_model_path
    from spade.queues.config import make_queue
    from spade.sandbox.client import SandboxClient

    tokenizer = resolve_model_path(settings.tokenizer_path)
    if memory_factory is None:
        from spade.memory.client import MemoryClient

        def memory_factory(target: str) -> object:
            return MemoryClient(target, timeout_s=settings.memory.timeout_s)

    queue = make_queue(settings.queue)
    endpoint = settings.sandbox
    sandbox = SandboxClient(
        endpoint.target,
        endpoint.key(),
        timeout_s=endpoint.timeout_s,
        open_timeout_s=endpoint.open_timeout_s,
        retry=endpoint.retry,
    )
    client = InferenceClient(settings.inference_urls, tokenizer_path=tokenizer, retry=settings.retry)
    memory_client = memory_factory(settings.memory.target)
    try:
        await client.wait_ready()
        designer = build_designer(
            settings,
            llm=InferencePolicy(client),
            validator=SandboxServiceValidator(sandbox),
            memory=MemoryServiceEnvironments(memory_client),  # type: ignore[arg-type]
            queue=queue,
        )
        async with following(settings.inference_discovery, client.set_urls):
            yield DesignerRuntime(designer=designer, queue=queue, settings=settings)
    finally:
        close = getattr(memory_client, "close", None)
        if close is not None:
            result = close()
            if hasattr(result, "__await__"):
                await result
        await client.aclose()
        await sandbox.close()
        await queue.close()
