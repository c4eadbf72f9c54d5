"""Settings rules, the worker's cadence over the real in-process queue, adapters, the CLI."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner
from pydantic import SecretStr, ValidationError

from services.designer.adapters import MemoryServiceEnvironments, parse_weight_version
from services.designer.cli import designer as designer_cli
from services.designer.core.loop import DesignerConfig
from services.designer.corpus.loader import CorpusSampler, load_jsonl
from services.designer.outbox import QueueOutbox
from services.designer.settings import DesignerSettings, SpecMismatch
from services.designer.worker import serve_forever
from spade.queues.base import SAMPLES_DESIGNER, WEIGHTS_PUBLISHED
from spade.queues.inprocess import InProcessQueue
from spade.runspec import RunSpec
from spade.v1 import queues_pb2

from .conftest import MarkerValidator, ScriptedPolicy, answer, make_designer


def test_the_prompt_and_output_budget_must_fit_the_context() -> None:
    with pytest.raises(ValidationError, match="context_tokens"):
        DesignerSettings(dev_mode=True, max_prompt_tokens=7000, max_new_tokens=2048)
    big = DesignerSettings(dev_mode=True, context_tokens=32768, max_prompt_tokens=16000, max_new_tokens=16000)
    assert big.setting == "game"
    with pytest.raises(ValidationError, match="doc_min_words"):
        DesignerSettings(dev_mode=True, doc_max_words=50, doc_min_words=100)
    # Unset, the answer length is the spec's: checked against the context when the spec is known.
    problems = DesignerSettings(dev_mode=True).spec_problems(RunSpec(designer_max_new_tokens=16384))
    assert len(problems) == 1 and "context_tokens" in problems[0] and "designer_max_new_tokens" in problems[0]


def test_settings_come_from_the_environment_and_unsafe_defaults_refuse_to_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SPADE_DESIGNER_SETTING", "tool")
    monkeypatch.setenv("SPADE_DESIGNER_ENVS_PER_ROUND", "12")
    with pytest.raises(ValidationError, match="SPADE_DESIGNER_SANDBOX__API_KEY"):
        DesignerSettings()  # refused when built: no caller has to remember a check
    monkeypatch.setenv("SPADE_DESIGNER_SANDBOX__API_KEY", "k")
    with pytest.raises(ValidationError, match="SPADE_DESIGNER_MEMORY__API_KEY"):
        DesignerSettings()
    monkeypatch.setenv("SPADE_DESIGNER_MEMORY__API_KEY", "m")
    monkeypatch.setenv("SPADE_DESIGNER_QUEUE__PUBLISH_TIMEOUT_S", "7")
    monkeypatch.setenv("SPADE_DESIGNER_CRITERIA_REACHABLE__ENABLED", "false")
    settings = DesignerSettings()
    assert (settings.setting, settings.envs_per_round) == ("tool", 12)
    assert not settings.criteria_reachable.enabled
    assert settings.sandbox.key() == "k" and "'k'" not in repr(settings)
    spec = RunSpec(envs_per_round=12, designer_max_new_tokens=1024)
    assert settings.loop_config(spec, structured=False).sampling.max_new_tokens == 1024
    assert settings.pipeline_config(spec).publish_timeout_s == 7.0
    assert DesignerSettings(dev_mode=True, sandbox={"api_key": None}).sandbox.api_key is None
    keyed = DesignerSettings(sandbox={"api_key": SecretStr("k2")}, memory={"api_key": SecretStr("m2")})
    assert keyed.sandbox.key() == "k2" and keyed.memory.key() == "m2"


def test_an_in_process_queue_is_refused_outside_dev_mode_never_a_silent_fallback() -> None:
    with pytest.raises(ValidationError, match="SPADE_DESIGNER_QUEUE__KIND=inprocess"):
        DesignerSettings(sandbox={"api_key": SecretStr("k")}, memory={"api_key": "m"}, queue={"kind": "inprocess"})
    assert DesignerSettings(dev_mode=True, queue={"kind": "inprocess"}).queue.kind == "inprocess"


def test_the_run_spec_decides_the_shared_fields_and_a_contradiction_names_each_one() -> None:
    spec = RunSpec(envs_per_round=8, skills_per_round=2, designer_max_new_tokens=1024, temperature=0.7, top_p=0.9)
    unset = DesignerSettings(dev_mode=True)
    assert unset.spec_problems(spec) == []
    config = unset.loop_config(spec, structured=True)
    assert (config.envs_per_round, config.skills_per_round, config.spec_id) == (8, 2, spec.spec_id)
    assert (config.sampling.temperature, config.sampling.top_p, config.sampling.max_new_tokens) == (0.7, 0.9, 1024)
    assert config.sampling.regex is not None
    assert (config.budget.max_turns, config.budget.max_tokens_per_turn) == (25, 8192)
    assert unset.pipeline_config(spec).agent_max_turns == 25

    agreeing = DesignerSettings(dev_mode=True, envs_per_round=8, temperature=0.7)
    assert agreeing.spec_problems(spec) == []
    clashing = DesignerSettings(dev_mode=True, envs_per_round=6, skills_per_round=3, top_p=0.9, max_new_tokens=512)
    problems = clashing.spec_problems(spec)
    assert [p.split(":")[0] for p in problems] == [
        "SPADE_DESIGNER_ENVS_PER_ROUND",
        "SPADE_DESIGNER_SKILLS_PER_ROUND",
        "SPADE_DESIGNER_MAX_NEW_TOKENS",
    ]
    assert "configured with 6 but the run spec has 8" in problems[0]
    with pytest.raises(SpecMismatch) as raised:
        clashing.check_spec(spec)
    assert raised.value.problems == problems


def test_every_settings_field_is_described() -> None:
    from services.designer.settings import CriteriaReachableSettings

    for model in (DesignerSettings, CriteriaReachableSettings):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"


def test_weight_versions_from_the_server_become_integers() -> None:
    assert parse_weight_version("default") == 0
    assert parse_weight_version("42") == 42
    with pytest.raises(ValueError, match="integer"):
        parse_weight_version("main-branch")


async def test_serve_designs_a_batch_at_start_and_every_k_versions(
    config_for: Callable[..., DesignerConfig],
    queue: InProcessQueue,
    memory: MemoryServiceEnvironments,
    documents: CorpusSampler,
) -> None:
    policy = ScriptedPolicy([answer(f"V{i}") for i in range(10)])
    designer = make_designer(config_for(skills_per_round=1), policy, QueueOutbox(queue), memory, documents)  # type: ignore[arg-type]
    stop = asyncio.Event()

    async def publish(version: int) -> None:
        message = queues_pb2.WeightsPublished(weight_version=version)
        await queue.publish(WEIGHTS_PUBLISHED, message.SerializeToString(), key=f"v{version}")

    async def batches_reach(count: int) -> None:
        while len(policy.prompts) < count:
            await asyncio.sleep(0.01)

    async def rounds_finish(count: int) -> None:
        # A round ends with its designer sample published; stopping before that would cut it short.
        while await queue.length(SAMPLES_DESIGNER) < count:
            await asyncio.sleep(0.01)

    for version in (1, 2, 3):  # older than what the servers serve at start: no round for them
        await publish(version)
    task = asyncio.create_task(serve_forever(designer, queue, regenerate_every=2, stop=stop, initial_version=4))
    await batches_reach(1)  # at start
    await publish(5)  # one version later: too early
    await publish(6)  # two versions after 4: a round
    await batches_reach(2)
    await publish(7)  # one version later: too early
    await publish(8)  # two versions later: a round
    await batches_reach(3)
    await rounds_finish(3)
    stop.set()
    rounds = await task
    assert [version for version, _ in rounds] == [4, 6, 8]
    # Rounds are numbered from the version served at start, then one by one (the skill rotation).
    assert [r.round_index for _, r in rounds] == [2, 3, 4]
    assert [r.records[0].skill for _, r in rounds] == ["Spatial Reasoning", "Pattern Recognition", "Optimization"]
    assert await queue.pending(WEIGHTS_PUBLISHED, "designer") == 0


def test_build_corpus_command_writes_the_tool_corpus(tmp_path: Path) -> None:
    result = CliRunner().invoke(designer_cli, ["build-corpus", "--setting", "tool", "--cache-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "tool:" in result.output
    assert len(load_jsonl(tmp_path / "tool.jsonl")) > 500


def test_serve_refuses_to_start_without_a_sandbox_key_outside_dev_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    from services.designer.cli import serve

    monkeypatch.delenv("SPADE_DESIGNER_SANDBOX__API_KEY", raising=False)
    monkeypatch.delenv("SPADE_DESIGNER_DEV_MODE", raising=False)
    result = CliRunner().invoke(serve, [])
    assert result.exit_code == 2
    assert "SPADE_DESIGNER_SANDBOX__API_KEY" in result.output and "Traceback" not in result.output


async def test_sigterm_mid_round_ends_the_worker_and_keeps_the_generated_answer(
    config_for: Callable[..., DesignerConfig],
    queue: InProcessQueue,
    memory: MemoryServiceEnvironments,
    documents: CorpusSampler,
) -> None:
    from .conftest import RecordingOutbox

    # Slot 0 has answered and is validating; slot 1's generation never ends (a 900 s batch deadline).
    policy = ScriptedPolicy([answer("Kept", marker="slow"), answer("Never")], delays=[0.0, float("inf")])
    validator = MarkerValidator(release=policy.cancelled)
    outbox = RecordingOutbox()
    config = config_for(envs_per_round=2, concurrency=2, batch_timeout_s=900.0, grace_s=30.0)
    designer = make_designer(config, policy, outbox, memory, documents, validator)
    stop = asyncio.Event()
    task = asyncio.create_task(serve_forever(designer, queue, regenerate_every=1, stop=stop))
    while validator.calls == 0 or len(policy.prompts) < 2:
        await asyncio.sleep(0.01)
    stop.set()  # what the first SIGTERM does (spade.serving.run.run_until_signalled)
    ((_, stopped),) = await asyncio.wait_for(task, timeout=60)  # bounded: never the 900 s deadline
    assert stopped.stopped and [r.outcome.value for r in stopped.records] == ["valid"]
    assert [s.valid for s in outbox.samples] == [True]


async def test_a_spent_pool_designs_no_more_rounds(queue: InProcessQueue) -> None:
    from services.designer.core.rounds import BatchResult

    class SpentPool:
        exhausted = False
        rounds = 0

        async def run_batch(
            self, *, round_index: int | None = None, stop: asyncio.Event | None = None, weight_version: int = 0
        ) -> BatchResult:
            self.rounds += 1
            self.exhausted = True
            return BatchResult(batch_id=f"r{round_index}", records=(), timed_out=False, round_index=round_index or 0)

    pool = SpentPool()
    stop = asyncio.Event()
    task = asyncio.create_task(serve_forever(pool, queue, regenerate_every=1, stop=stop))
    for version in (1, 2):
        message = queues_pb2.WeightsPublished(weight_version=version).SerializeToString()
        await queue.publish(WEIGHTS_PUBLISHED, message, key=f"v{version}")
    while await queue.length(WEIGHTS_PUBLISHED):  # both versions read and acknowledged by the designer
        await asyncio.sleep(0.05)
    stop.set()
    assert len(await task) == 1 and pool.rounds == 1
