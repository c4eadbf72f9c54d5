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
from services.designer.core.loop import Designer, DesignerConfig
from services.designer.corpus.loader import CorpusSampler, load_jsonl
from services.designer.outbox import QueueOutbox
from services.designer.settings import DesignerSettings
from services.designer.worker import serve_forever
from spade.queues.base import WEIGHTS_PUBLISHED
from spade.queues.inprocess import InProcessQueue
from spade.v1 import queues_pb2

from .conftest import MarkerValidator, ScriptedPolicy, answer


def test_the_prompt_and_output_budget_must_fit_the_context() -> None:
    with pytest.raises(ValidationError, match="context_tokens"):
        DesignerSettings(dev_mode=True, max_prompt_tokens=7000, max_new_tokens=2048)
    big = DesignerSettings(dev_mode=True, context_tokens=32768, max_prompt_tokens=16000, max_new_tokens=16000)
    assert big.setting == "game"
    with pytest.raises(ValidationError, match="doc_min_words"):
        DesignerSettings(dev_mode=True, doc_max_words=50, doc_min_words=100)


def test_settings_come_from_the_environment_and_unsafe_defaults_refuse_to_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SPADE_DESIGNER_SETTING", "tool")
    monkeypatch.setenv("SPADE_DESIGNER_ENVS_PER_BATCH", "12")
    with pytest.raises(ValidationError, match="SPADE_DESIGNER_SANDBOX__API_KEY"):
        DesignerSettings()  # refused when built: no caller has to remember a check
    monkeypatch.setenv("SPADE_DESIGNER_SANDBOX__API_KEY", "k")
    monkeypatch.setenv("SPADE_DESIGNER_QUEUE__PUBLISH_TIMEOUT_S", "7")
    settings = DesignerSettings()
    assert (settings.setting, settings.envs_per_batch) == ("tool", 12)
    assert settings.sandbox.key() == "k" and "'k'" not in repr(settings)
    assert settings.loop_config().sampling.max_new_tokens == settings.max_new_tokens
    assert settings.loop_config().publish_timeout_s == 7.0
    assert DesignerSettings(dev_mode=True, sandbox={"api_key": None}).sandbox.api_key is None
    assert DesignerSettings(sandbox={"api_key": SecretStr("k2")}).sandbox.key() == "k2"


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
    designer = Designer(
        config_for(),
        llm=policy,
        validator=MarkerValidator(),
        memory=memory,
        outbox=QueueOutbox(queue),
        documents=documents,
    )
    stop = asyncio.Event()

    async def publish(version: int) -> None:
        message = queues_pb2.WeightsPublished(weight_version=version)
        await queue.publish(WEIGHTS_PUBLISHED, message.SerializeToString(), key=f"v{version}")

    async def batches_reach(count: int) -> None:
        while len(policy.prompts) < count:
            await asyncio.sleep(0.01)

    for version in (1, 2, 3):
        await publish(version)
    task = asyncio.create_task(serve_forever(designer, queue, regenerate_every=2, stop=stop))
    await batches_reach(2)  # at start, then once for v1..v3 together (the newest weights)
    await publish(4)  # one version later: too early
    await publish(5)  # two versions later: a batch
    await batches_reach(3)
    stop.set()
    batches = await task
    assert [version for version, _ in batches] == [0, 3, 5]
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


def test_sandbox_reports_become_the_cores_validation_result() -> None:
    from services.designer.adapters import validation_result
    from services.designer.core.ports import Check
    from spade.envs import CheckResult, ValidationReport

    checks = [CheckResult("syntax", True, "parses"), CheckResult("structure", False, "missing solution()")]
    report = ValidationReport(valid=False, setting="game", env_class="AEnv", checks=checks, repaired_code="x = 1")
    result = validation_result(report)
    assert not result.valid and result.env_class == "AEnv" and result.repaired_code == "x = 1"
    assert result.checks == (Check("syntax", True, "parses"), Check("structure", False, "missing solution()"))
