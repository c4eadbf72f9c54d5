"""The designer over the real sandbox: the contract's example envs pass the whole pipeline, broken
variants are rejected with the failing check named, and prompts fit SmolLM2's real context.

The policy is scripted with real env code (a 135M model cannot write valid envs); the real model's
own attempts are exercised in ``test_real_model.py``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from services.designer.adapters import MemoryServiceEnvironments, PoolValidator, SandboxServiceValidator
from services.designer.core.attempt import AttemptOutcome
from services.designer.core.loop import Designer, DesignerConfig
from services.designer.core.pipeline import AttemptPipeline, PipelineConfig
from services.designer.core.ports import Sampling
from services.designer.core.prompts import PromptParts, fit_prompt, render_messages, truncate_words
from services.designer.core.skills import skill_named
from services.designer.corpus.loader import CorpusSampler, parse_lines
from services.designer.outbox import QueueOutbox
from services.designer.settings import DesignerSettings
from services.designer.wiring import load_examples, repair
from services.memory.service import MemoryService
from services.memory.store.sql import SqlStore, make_engine, migrate
from services.sandbox.isolation import IsolationSettings, SandboxPool
from spade.envs import CHECK_NAMES, CheckConfig
from spade.envs.examples import EXAMPLES
from spade.queues.base import ENVS_READY, SAMPLES_DESIGNER
from spade.queues.config import InProcessQueueConfig
from spade.queues.inprocess import InProcessQueue
from spade.v1 import queues_pb2
from tests.conftest import needs
from tests.unit.designer.conftest import ScriptedPolicy, drain

CHECKS = CheckConfig(seed_count=3, random_policy_episodes=10)


def as_answer(code: str, hint: str) -> str:
    return f"Here is the environment.\n```python\n{code}```\n### HINT\n{hint}\n"


@pytest.fixture
@needs("sandbox")
async def pool() -> AsyncIterator[SandboxPool]:
    pool = SandboxPool(IsolationSettings())
    await pool.start()
    try:
        yield pool
    finally:
        await pool.stop()


@pytest.fixture
def memory_service(tmp_path: Path) -> MemoryService:
    engine = make_engine(f"sqlite:///{tmp_path / 'memory.db'}")
    migrate(engine)
    return MemoryService(SqlStore(engine))


@pytest.mark.parametrize("setting", ["game", "tool"])
async def test_example_envs_pass_and_broken_ones_fail_with_the_check_named(
    setting: str, pool: SandboxPool, memory_service: MemoryService
) -> None:
    example = next(e for e in EXAMPLES.values() if e.setting == setting)
    if setting == "game":
        # Seeding with a constant makes every seed the same instance: the memorisable-instance defect.
        broken = example.code.replace("random.Random(seed)", "random.Random(7)")
    else:
        broken = example.code.replace("def solution(self)", "def answer_key(self)")
    assert broken != example.code
    # A valid answer, a broken env, and valid code without the hint section.
    script: list[str | Exception] = [
        as_answer(example.code, example.hint),
        as_answer(broken, "x"),
        f"```python\n{example.code}```",
    ]
    policy = ScriptedPolicy(script, weight_version=2)
    queue = InProcessQueue(InProcessQueueConfig(max_len=100))
    config = DesignerConfig(
        setting=setting,
        envs_per_round=3,
        skills_per_round=3,
        max_attempts_per_env=1,
        concurrency=1,
        sampling=Sampling(max_new_tokens=64),
    )
    memory = MemoryServiceEnvironments(memory_service)
    pipeline = AttemptPipeline(
        PipelineConfig(setting=setting, agent_max_turns=25),
        validator=PoolValidator(pool, CHECKS),
        memory=memory,
        outbox=QueueOutbox(queue),
        repair=repair,
    )
    designer = Designer(
        config,
        llm=policy,
        pipeline=pipeline,
        memory=memory,
        documents=CorpusSampler(parse_lines([json.dumps({"text": "a document"})])),
        examples=load_examples(setting),
    )
    result = await designer.run_batch()
    outcomes = [r.outcome for r in result.records]
    assert outcomes.count(AttemptOutcome.VALID) == 1
    assert outcomes.count(AttemptOutcome.MALFORMED) == 1
    valid = next(r for r in result.records if r.outcome is AttemptOutcome.VALID)
    env = await memory_service.get_environment(valid.env_id)
    assert env.status == "valid" and env.hint == example.hint.strip() and env.env_class.endswith("Env")
    assert [c["name"] for c in env.validation_report["checks"]] == list(CHECK_NAMES)

    samples = [queues_pb2.DesignerSample.FromString(p) for p in await drain(queue, SAMPLES_DESIGNER)]
    assert len(samples) == 3 and all(s.weight_version == 2 for s in samples)
    bad = next(r for r in result.records if r.outcome is AttemptOutcome.INVALID)
    assert bad.failed_check == ("seed_variety" if setting == "game" else "structure"), bad.checks
    assert [queues_pb2.EnvReady.FromString(p).env_id for p in await drain(queue, ENVS_READY)] == [valid.env_id]
    await queue.close()


@pytest.mark.sandbox
async def test_the_validator_speaks_to_the_sandbox_service_through_the_shared_client() -> None:
    from services.sandbox.settings import SandboxSettings
    from services.sandbox.wiring import serving
    from spade.sandbox.client import SandboxClient

    settings = SandboxSettings.model_validate({"grpc": {"port": 0}, "http": {"port": 0}, "dev_mode": True})
    async with serving(settings) as running, SandboxClient(f"127.0.0.1:{running.grpc_port}") as client:
        validator = SandboxServiceValidator(client)
        example = EXAMPLES["code_breaker"]  # no random wins: its random_policy check cannot fail by chance
        report = await validator.validate(example.code, "game", agent_max_turns=25)
        assert report.valid and report.env_class == "CodeBreakerEnv", report.checks
        assert [c.name for c in report.checks] == list(CHECK_NAMES) and report.repaired_code == example.code
        # The agent's budget travels with the request: a budget below what solution() needs fails it.
        tight = await validator.validate(example.code, "game", agent_max_turns=1)
        assert not tight.valid
        failed = next(c for c in tight.checks if not c.passed)
        assert failed.name in {"solution_replay", "termination"} and "1" in failed.detail, failed
        bad = await validator.validate(
            "class BrokenEnv:\n    def reset(self, seed=None):\n", "game", agent_max_turns=25
        )
        assert not bad.valid and not bad.checks[0].passed and bad.checks[0].name == "syntax"


@pytest.mark.model
@pytest.mark.slow  # loading the real tokenizer takes several seconds on 2 cores
def test_default_prompts_fit_smollm2_context_with_the_real_tokenizer() -> None:
    from spade.inference.chat import ChatFormatter
    from spade.inference.models import ensure_default_model, load_tokenizer

    settings = DesignerSettings(dev_mode=True, max_new_tokens=2048)
    formatter = ChatFormatter(load_tokenizer(ensure_default_model()))
    long_doc = " ".join(f"theorem{i} states that x{i} + y{i} = z{i}." for i in range(2000))
    for setting in ("game", "tool"):
        for example in load_examples(setting):
            parts = PromptParts(
                setting=setting,
                skill=skill_named(setting, "Optimization" if setting == "game" else "Tool Selection"),
                document=truncate_words(long_doc, settings.doc_max_words),
                example=example,
            )
            fitted = fit_prompt(
                parts,
                formatter.apply,
                max_prompt_tokens=settings.max_prompt_tokens,
                doc_min_words=settings.doc_min_words,
            )
            assert len(fitted.prompt_ids) <= settings.max_prompt_tokens
            assert fitted.parts.example == example  # the example always fits the default budget
            assert fitted.prompt_ids == formatter.apply(render_messages(fitted.parts))
    assert settings.max_prompt_tokens + 2048 <= 8192
