r"""``criteria_reachable``: the verdict logic over a stub policy (the real model's plumbing is tested in
tests/integration/designer/test_real_model.py). An unknown verdict is never an acceptance."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from services.designer.adapters import MemoryServiceEnvironments, PolicyGeneration
from services.designer.core.attempt import AttemptOutcome
from services.designer.core.loop import DesignerConfig
from services.designer.core.ports import Sampling
from services.designer.core.reachability import (
    CRITERIA_REACHABLE_CHECK,
    VERDICT_REGEX,
    CriteriaReachable,
    Reachability,
    ReachabilityConfig,
    parse_verdict,
    verdict_messages,
)
from services.designer.corpus.loader import CorpusSampler
from services.memory.service import MemoryService

from .conftest import RecordingOutbox, ScriptedPolicy, answer, make_designer, words


@pytest.mark.parametrize(
    ("reply", "verdict", "answers"),
    [
        ("Criterion 1: \\boxed{yes}\nCriterion 2: \\boxed{yes}", Reachability.REACHABLE, (True, True)),
        ("Trace...\nCriterion 1: \\boxed{yes}\nCriterion 2: \\boxed{no}", Reachability.UNREACHABLE, (True, False)),
        ("\\boxed{true} \\boxed{Y}", Reachability.REACHABLE, (True, True)),  # unlabelled: in order
        ("", Reachability.UNKNOWN, ()),
        ("   \n", Reachability.UNKNOWN, ()),
        ("All criteria look reachable to me.", Reachability.UNKNOWN, ()),  # the reference accepted this
        ("Criterion 1: \\boxed{yes}\nCriterion 2: \\boxed{maybe}", Reachability.UNKNOWN, (True, None)),
        ("Criterion 2: \\boxed{no}\nCriterion 1: \\boxed{maybe}", Reachability.UNREACHABLE, (None, False)),
        ("Criterion 1: \\boxed{no}\nCriterion 1: \\boxed{yes}", Reachability.REACHABLE, (True,)),  # last word
    ],
)
def test_the_verdict_is_explicit_and_a_missing_box_is_unknown_never_accept(
    reply: str, verdict: Reachability, answers: tuple[bool | None, ...]
) -> None:
    parsed = parse_verdict(reply)
    assert parsed.verdict is verdict and parsed.answers == answers
    assert parsed.detail


def test_the_unreachable_criteria_are_named() -> None:
    parsed = parse_verdict("Criterion 1: \\boxed{yes}\nCriterion 2: \\boxed{no}\nCriterion 3: \\boxed{no}")
    assert parsed.detail == "criterion 2, 3 judged unreachable"


def test_the_structured_verdict_format_parses() -> None:
    import re

    reply = "Criterion 1: \\boxed{yes}\nCriterion 2: \\boxed{no}\n"
    assert re.fullmatch(VERDICT_REGEX, reply)
    assert parse_verdict(reply).verdict is Reachability.UNREACHABLE


def test_the_judge_sees_the_code_and_the_line_format() -> None:
    system, user = verdict_messages("class ShopEnv(ToolEnv):\n    pass\n")
    assert "difficulty" in system["content"]
    assert "class ShopEnv(ToolEnv)" in user["content"]
    assert "Criterion 1: \\boxed{yes}" in user["content"] and "self.criteria" in user["content"]


@dataclass
class StubJudge:
    """A policy port that answers the judge's prompt from a script (the verdict logic under test)."""

    replies: list[str]
    seen: list[Sampling] = field(default_factory=list)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        return words(messages)

    async def generate(self, input_ids: list[int], sampling: Sampling) -> PolicyGeneration:
        self.seen.append(sampling)
        text = self.replies[min(len(self.seen) - 1, len(self.replies) - 1)]
        return PolicyGeneration(output_ids=[1], logprobs=[-0.1], finish_reason="stop", weight_version=0, text=text)


def judge(
    replies: list[str], *, tries: int = 2, max_prompt_tokens: int = 10_000
) -> tuple[CriteriaReachable, StubJudge]:
    stub = StubJudge(replies)
    config = ReachabilityConfig(
        Sampling(max_new_tokens=64, temperature=0.3), tries=tries, max_prompt_tokens=max_prompt_tokens
    )
    return CriteriaReachable(stub, config), stub


async def test_reachable_passes_and_unreachable_fails_naming_the_criterion() -> None:
    check, _ = judge(["Criterion 1: \\boxed{yes}"])
    result = await check.check("class AEnv: ...")
    assert result.name == CRITERIA_REACHABLE_CHECK and result.passed and "reply 1" in result.detail

    check, _ = judge(["Criterion 1: \\boxed{yes}\nCriterion 2: \\boxed{no}"])
    result = await check.check("class AEnv: ...")
    assert not result.passed and "criterion 2" in result.detail and "tool write the state" in result.detail


async def test_unknown_is_retried_then_reported_as_a_failed_check_saying_unknown() -> None:
    check, stub = judge(["", "no verdict here"], tries=2)
    result = await check.check("class AEnv: ...", seeds=[11, 12])
    assert not result.passed and result.detail.startswith("unknown:") and "after 2 replies" in result.detail
    assert [s.seed for s in stub.seen] == [11, 12] and all(s.temperature == 0.3 for s in stub.seen)

    check, stub = judge(["I am not sure", "Criterion 1: \\boxed{yes}"], tries=3)
    result = await check.check("class AEnv: ...")
    assert result.passed and len(stub.seen) == 2  # a verdict ends the tries


async def test_code_too_long_for_the_judge_is_unknown_not_accepted() -> None:
    check, stub = judge(["Criterion 1: \\boxed{yes}"], max_prompt_tokens=5)
    result = await check.check("class AEnv: ...")
    assert not result.passed and "unknown" in result.detail and "max_prompt_tokens=5" in result.detail
    assert stub.seen == []


async def test_in_the_pipeline_a_tool_env_judged_unreachable_is_stored_invalid_with_the_check(
    config_for: Callable[..., DesignerConfig],
    outbox: RecordingOutbox,
    memory: MemoryServiceEnvironments,
    memory_service: MemoryService,
    documents: CorpusSampler,
) -> None:
    reachability, stub = judge(["Criterion 1: \\boxed{no}"])
    config = config_for(setting="tool", envs_per_round=1)
    designer = make_designer(
        config, ScriptedPolicy([answer("Shop")]), outbox, memory, documents, reachability=reachability
    )
    result = await designer.run_batch()
    (record,) = result.records
    assert record.outcome is AttemptOutcome.INVALID and record.failed_check == CRITERIA_REACHABLE_CHECK
    assert record.checks[-1].name == CRITERIA_REACHABLE_CHECK
    (sample,) = outbox.samples
    assert sample.outcome == CRITERIA_REACHABLE_CHECK and not sample.valid and outbox.ready == []
    stored = await memory_service.get_environment(sample.env_id)
    report = stored.validation_report
    assert report["checks"][-1]["name"] == CRITERIA_REACHABLE_CHECK and not report["checks"][-1]["passed"]
    assert len(stub.seen) == 1


async def test_game_envs_are_not_judged_and_an_outage_of_the_judge_is_infrastructure(
    config_for: Callable[..., DesignerConfig],
    outbox: RecordingOutbox,
    memory: MemoryServiceEnvironments,
    documents: CorpusSampler,
) -> None:
    reachability, stub = judge(["Criterion 1: \\boxed{no}"])
    game = make_designer(
        config_for(), ScriptedPolicy([answer("Game")]), outbox, memory, documents, reachability=reachability
    )
    assert (await game.run_batch()).records[0].outcome is AttemptOutcome.VALID and stub.seen == []

    class Down(StubJudge):
        async def generate(self, input_ids: list[int], sampling: Sampling) -> PolicyGeneration:
            raise ConnectionError("inference down")

    down = CriteriaReachable(Down([]), ReachabilityConfig(Sampling(max_new_tokens=8)))
    tool = make_designer(
        config_for(setting="tool"), ScriptedPolicy([answer("Tool")]), outbox, memory, documents, reachability=down
    )
    (record,) = (await tool.run_batch()).records
    assert record.outcome is AttemptOutcome.INFRA_FAILED and "inference down" in record.error
