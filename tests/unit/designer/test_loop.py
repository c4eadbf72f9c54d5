"""The designer loop end to end over the real SQLite memory; what it publishes, as domain objects."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Callable, Sequence

from services.designer.adapters import MemoryServiceEnvironments
from services.designer.core.attempt import AttemptOutcome
from services.designer.core.loop import DesignerConfig
from services.designer.core.prompts import AgentBudget
from services.designer.corpus.loader import CorpusSampler
from services.memory.service import MemoryService
from spade.envs import CHECK_NAMES

from .conftest import MarkerValidator, RecordingOutbox, ScriptedPolicy, answer
from .conftest import make_designer as make

NO_HINT = "```python\nclass AEnv:\n    pass\n```\n"
"""An answer with code and no hint: malformed."""


async def test_a_valid_attempt_is_stored_enqueued_and_becomes_a_trainable_sample(
    config_for: Callable[..., DesignerConfig],
    outbox: RecordingOutbox,
    memory: MemoryServiceEnvironments,
    memory_service: MemoryService,
    documents: CorpusSampler,
) -> None:
    policy = ScriptedPolicy([answer("Parity")], weight_version=7)
    config = config_for(spec_id="spec-7", budget=AgentBudget(max_turns=6, max_tokens_per_turn=300))
    validator = MarkerValidator()
    result = await make(config, policy, outbox, memory, documents, validator).run_batch(round_index=4)

    (record,) = result.records
    assert record.outcome is AttemptOutcome.VALID and result.env_ids == [record.env_id]
    env = await memory_service.get_environment(record.env_id)
    assert env.hint == "Think about parity." and "class ParityEnv" in env.code
    assert env.status == "valid" and env.weight_version == 7 and env.designer_sample_id == record.sample_id
    assert env.skill == "Optimization" and env.corpus_ref.startswith("doc")  # round 4, one skill: the 5th

    (message,) = outbox.ready
    assert (message.env_id, message.setting, message.skill) == (record.env_id, "game", env.skill)
    assert message.weight_version == 7 and message.designer_sample_id == record.sample_id
    assert message.spec_id == "spec-7"

    (sample,) = outbox.samples
    assert sample.valid and sample.failed_check == "" and sample.env_id == record.env_id
    assert list(sample.prompt_ids) == policy.prompts[0]  # exactly what the model was conditioned on
    assert len(sample.output_ids) == len(sample.output_logprobs) == len(answer("Parity").split())
    assert sample.weight_version == 7 and sample.batch_id == result.batch_id
    assert result.batch_id.startswith("r4-") and result.round_index == 4
    assert (sample.spec_id, sample.outcome, sample.trainable, sample.constrained) == ("spec-7", "valid", True, False)
    assert [c.name for c in sample.checks] == list(CHECK_NAMES)
    # The agent's budget is stated in the prompt and is the one validation replays solution() within.
    assert validator.budgets == [6]
    prompt = policy.messages[0][1]["content"]
    assert "at most 6 turns" in prompt and "300 tokens per turn" in prompt

    # The memory counted the attempt (validity figures come from these records).
    attempts = (await memory_service.stats()).attempts
    assert (attempts.attempts, attempts.by_outcome) == (1, {"valid": 1})


async def test_a_malformed_answer_is_a_sample_with_the_reason_and_the_slot_retries(
    config_for: Callable[..., DesignerConfig],
    outbox: RecordingOutbox,
    memory: MemoryServiceEnvironments,
    documents: CorpusSampler,
) -> None:
    policy = ScriptedPolicy([NO_HINT, answer("Second")])
    result = await make(config_for(max_attempts_per_env=3), policy, outbox, memory, documents).run_batch()

    assert [r.outcome for r in result.records] == [AttemptOutcome.MALFORMED, AttemptOutcome.VALID]
    first, second = outbox.samples
    assert not first.valid and first.failed_check == "output_format" and first.env_id == ""
    assert first.outcome == "malformed" and second.outcome == "valid"
    assert "### HINT" in first.checks[0].detail
    assert second.valid
    assert len(outbox.ready) == 1
    # A new document per attempt.
    docs = [m[1]["content"].split("<REFERENCE_DOCUMENT>")[1][:30] for m in policy.messages]
    assert docs[0] != docs[1]


async def test_an_env_failing_a_check_is_kept_invalid_and_its_sample_names_the_check(
    config_for: Callable[..., DesignerConfig],
    outbox: RecordingOutbox,
    memory: MemoryServiceEnvironments,
    memory_service: MemoryService,
    documents: CorpusSampler,
) -> None:
    policy = ScriptedPolicy([answer("Replay", marker="fail:solution_replay")])
    result = await make(config_for(), policy, outbox, memory, documents).run_batch()

    (record,) = result.records
    assert record.outcome is AttemptOutcome.INVALID and result.env_ids == []
    (sample,) = outbox.samples
    assert not sample.valid and sample.failed_check == "solution_replay" and sample.outcome == "solution_replay"
    assert "did not win" in next(c.detail for c in sample.checks if c.name == "solution_replay")
    stored = await memory_service.get_environment(sample.env_id)
    assert stored.status == "invalid" and stored.validation_report["valid"] is False
    assert outbox.ready == []


async def test_a_duplicate_env_is_not_enqueued_twice(
    config_for: Callable[..., DesignerConfig],
    outbox: RecordingOutbox,
    memory: MemoryServiceEnvironments,
    documents: CorpusSampler,
) -> None:
    policy = ScriptedPolicy([answer("Same")])
    designer = make(config_for(envs_per_round=2, concurrency=1), policy, outbox, memory, documents)
    result = await designer.run_batch()

    outcomes = sorted(r.outcome.value for r in result.records)
    assert outcomes == ["duplicate", "valid"]
    assert len(outbox.ready) == 1
    dup = next(s for s in outbox.samples if not s.valid)
    assert dup.failed_check == "duplicate" and dup.env_id == "" and dup.outcome == "duplicate"


async def test_inference_failures_produce_no_sample_and_the_slot_moves_on(
    config_for: Callable[..., DesignerConfig],
    outbox: RecordingOutbox,
    memory: MemoryServiceEnvironments,
    documents: CorpusSampler,
) -> None:
    policy = ScriptedPolicy([RuntimeError("server down"), answer("After")])
    result = await make(config_for(max_attempts_per_env=2), policy, outbox, memory, documents).run_batch()
    assert [r.outcome for r in result.records] == [AttemptOutcome.GENERATION_FAILED, AttemptOutcome.VALID]
    assert "server down" in result.records[0].error
    assert [s.valid for s in outbox.samples] == [True]


async def test_the_deadline_keeps_every_finished_attempt(
    config_for: Callable[..., DesignerConfig],
    outbox: RecordingOutbox,
    memory: MemoryServiceEnvironments,
    documents: CorpusSampler,
) -> None:
    # Slot 0 finishes at once; slot 1 has generated and is still validating when the deadline
    # fires (its validation waits until the deadline has cancelled slot 2, which never answers).
    # 0 and 1 are kept, 2 is cancelled.
    policy = ScriptedPolicy(
        [answer("Fast"), answer("Validating", marker="slow"), answer("Never")], delays=[0.0, 0.0, float("inf")]
    )
    validator = MarkerValidator(release=policy.cancelled)
    config = config_for(envs_per_round=3, concurrency=3, batch_timeout_s=2.0)
    result = await make(config, policy, outbox, memory, documents, validator).run_batch()

    assert result.timed_out
    names = sorted(r.code.split("class ")[1].split("Env")[0] for r in result.records)
    assert names == ["Fast", "Validating"]
    assert all(r.outcome is AttemptOutcome.VALID for r in result.records)
    assert len(outbox.ready) == 2 and len(outbox.samples) == 2


async def test_concurrency_is_bounded_and_rounds_rotate_their_skills(
    config_for: Callable[..., DesignerConfig],
    outbox: RecordingOutbox,
    memory: MemoryServiceEnvironments,
    documents: CorpusSampler,
) -> None:
    policy = ScriptedPolicy([answer(f"E{i}") for i in range(12)], delays=[0.02] * 12)
    config = config_for(envs_per_round=6, skills_per_round=3, concurrency=2)
    designer = make(config, policy, outbox, memory, documents)
    first = await designer.run_batch()
    assert policy.max_in_flight == 2
    assert Counter(r.skill for r in first.records) == {
        "Mathematical Reasoning": 2,
        "Logical Deduction": 2,
        "Spatial Reasoning": 2,
    }
    assert first.validity_rate == 1.0
    second = await designer.run_batch()
    assert second.batch_id != first.batch_id and second.round_index == first.round_index + 1
    assert {r.skill for r in second.records} == {"Pattern Recognition", "Optimization", "Causal Inference"}
    assert {s.batch_id for s in outbox.samples} == {first.batch_id, second.batch_id}
    # Each sample's skill is its slot's: the learner centres within (round, skill).
    assert all(s.skill in {r.skill for r in first.records} for s in outbox.samples if s.batch_id == first.batch_id)


async def test_generations_are_seeded_from_run_round_slot_and_attempt(
    config_for: Callable[..., DesignerConfig],
    outbox: RecordingOutbox,
    memory: MemoryServiceEnvironments,
    documents: CorpusSampler,
) -> None:
    from services.designer.wiring import designer_seeds

    seeds = designer_seeds("spec-a")
    policy = ScriptedPolicy([NO_HINT, answer("B"), answer("C")])
    config = config_for(envs_per_round=2, max_attempts_per_env=2, concurrency=1)
    await make(config, policy, outbox, memory, documents, seeds=seeds).run_batch(round_index=5)
    used = [s.seed for s in policy.samplings]
    # One slot retried once (attempt 1), the other succeeded at once; the order of slots may vary.
    expected = {seeds(5, 0, 0, "design", 0), seeds(5, 1, 0, "design", 0)}
    retried = {seeds(5, 0, 1, "design", 0), seeds(5, 1, 1, "design", 0)}
    assert len(set(used)) == 3 and expected < set(used) and len(set(used) & retried) == 1
    assert designer_seeds("spec-a")(5, 0, 0, "design", 0) == used[0]  # reproducible in any process
    assert designer_seeds("spec-b")(5, 0, 0, "design", 0) != used[0]  # another run, other seeds


async def test_structured_output_constrains_the_generation_and_marks_the_sample(
    config_for: Callable[..., DesignerConfig],
    outbox: RecordingOutbox,
    memory: MemoryServiceEnvironments,
    documents: CorpusSampler,
) -> None:
    from services.designer.core.ports import Sampling
    from spade.inference.answer_format import DESIGNER_ANSWER_REGEX

    policy = ScriptedPolicy([answer("Shaped")])
    config = config_for(sampling=Sampling(max_new_tokens=64, regex=DESIGNER_ANSWER_REGEX))
    await make(config, policy, outbox, memory, documents).run_batch()
    assert policy.samplings[0].regex == DESIGNER_ANSWER_REGEX
    (sample,) = outbox.samples
    assert sample.constrained


async def test_a_frozen_designer_publishes_scored_but_untrainable_samples(
    config_for: Callable[..., DesignerConfig],
    outbox: RecordingOutbox,
    memory: MemoryServiceEnvironments,
    documents: CorpusSampler,
) -> None:
    await make(config_for(trainable=False), ScriptedPolicy([answer("Frozen")]), outbox, memory, documents).run_batch()
    (sample,) = outbox.samples
    assert sample.valid and not sample.trainable


async def test_memory_examples_reach_the_prompt(
    config_for: Callable[..., DesignerConfig],
    outbox: RecordingOutbox,
    documents: CorpusSampler,
) -> None:
    from services.designer.core.ports import (
        AttemptSummary,
        EnvironmentRecord,
        MemoryExample,
        MemoryExamples,
        StoreResult,
    )

    class Examples(MemoryServiceEnvironments):
        def __init__(self) -> None:
            pass

        async def sample_examples(self, setting: str, skill: str, n_positive: int, n_negative: int) -> MemoryExamples:
            return MemoryExamples(
                positives=(MemoryExample("class GoodEnv:\n    pass", "learnable: win rate 0.50, regret 0.40"),),
                negatives=(MemoryExample("class EasyEnv:\n    pass", "too easy: win rate 0.95"),),
            )

        async def store(self, record: EnvironmentRecord) -> StoreResult:
            raise ConnectionError("memory unreachable")

        async def record_attempts(self, attempts: Sequence[AttemptSummary]) -> None:
            raise ConnectionError("memory unreachable")

    policy = ScriptedPolicy([answer("X")])
    result = await make(config_for(), policy, outbox, Examples(), documents).run_batch()
    prompt = policy.messages[0][1]["content"]
    assert "class GoodEnv" in prompt and "regret 0.40" in prompt and "class EasyEnv" in prompt
    # A memory outage while storing a valid env is not the designer's fault: no sample, no env.
    assert result.records[0].outcome is AttemptOutcome.INFRA_FAILED
    assert outbox.samples == [] and outbox.ready == []


async def test_cancelling_a_batch_still_publishes_generated_attempts(
    config_for: Callable[..., DesignerConfig],
    outbox: RecordingOutbox,
    memory: MemoryServiceEnvironments,
    documents: CorpusSampler,
) -> None:
    policy = ScriptedPolicy([answer("Validating", marker="slow"), answer("Never")], delays=[0.0, float("inf")])
    validator = MarkerValidator(release=policy.cancelled)
    designer = make(config_for(envs_per_round=2, concurrency=2), policy, outbox, memory, documents, validator)
    batch = asyncio.create_task(designer.run_batch())
    while validator.calls == 0 or len(policy.prompts) < 2:
        await asyncio.sleep(0.01)
    batch.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await batch
    assert batch.cancelled()
    while not outbox.samples:  # the shielded attempt finishes on its own
        await asyncio.sleep(0.01)
    assert [s.valid for s in outbox.samples] == [True]
    assert len(outbox.ready) == 1


async def test_a_queue_outage_is_an_infrastructure_failure_not_the_designers(
    config_for: Callable[..., DesignerConfig],
    memory: MemoryServiceEnvironments,
    memory_service: MemoryService,
    documents: CorpusSampler,
) -> None:
    # The env cannot be announced: nobody would play it, so it yields no sample either.
    unannounced = RecordingOutbox(failing="ready")
    result = await make(config_for(), ScriptedPolicy([answer("Lost")]), unannounced, memory, documents).run_batch()
    (record,) = result.records
    assert record.outcome is AttemptOutcome.INFRA_FAILED and record.error == "queue: queue unreachable"
    assert unannounced.samples == []
    assert (await memory_service.get_environment(record.env_id)).status == "valid"  # kept in the memory

    # The env was announced but its sample was not published: the outcome stands, the error is kept.
    unsampled = RecordingOutbox(failing="sample")
    result = await make(config_for(), ScriptedPolicy([answer("Kept")]), unsampled, memory, documents).run_batch()
    (record,) = result.records
    assert record.outcome is AttemptOutcome.VALID and [r.env_id for r in unsampled.ready] == [record.env_id]
    assert record.error == "queue: designer sample not published: queue unreachable"


async def test_a_stop_request_ends_the_round_and_keeps_answers_already_generated(
    config_for: Callable[..., DesignerConfig],
    outbox: RecordingOutbox,
    memory: MemoryServiceEnvironments,
    documents: CorpusSampler,
) -> None:
    # Slot 0 has generated and is validating; slot 1 never answers. SIGTERM (stop) arrives: slot 1
    # is cancelled at once, slot 0's answer is finished and published, and the round returns.
    policy = ScriptedPolicy([answer("Validating", marker="slow"), answer("Never")], delays=[0.0, float("inf")])
    validator = MarkerValidator(release=policy.cancelled)
    config = config_for(envs_per_round=2, concurrency=2, batch_timeout_s=3600.0, grace_s=30.0)
    designer = make(config, policy, outbox, memory, documents, validator)
    stop = asyncio.Event()
    round_task = asyncio.create_task(designer.run_batch(stop=stop))
    while validator.calls == 0 or len(policy.prompts) < 2:
        await asyncio.sleep(0.01)
    stop.set()
    result = await round_task
    assert result.stopped and not result.timed_out
    assert [r.outcome for r in result.records] == [AttemptOutcome.VALID]
    assert [s.valid for s in outbox.samples] == [True] and len(outbox.ready) == 1


async def test_after_a_stop_an_answer_stuck_in_validation_is_abandoned_after_the_grace(
    config_for: Callable[..., DesignerConfig],
    outbox: RecordingOutbox,
    memory: MemoryServiceEnvironments,
    documents: CorpusSampler,
) -> None:
    # The validator never answers (an unreachable sandbox): shutdown still ends, after grace_s.
    policy = ScriptedPolicy([answer("Stuck", marker="slow")])
    validator = MarkerValidator(release=asyncio.Event())
    designer = make(config_for(grace_s=0.2), policy, outbox, memory, documents, validator)
    stop = asyncio.Event()
    round_task = asyncio.create_task(designer.run_batch(stop=stop))
    while validator.calls == 0:
        await asyncio.sleep(0.01)
    stop.set()
    result = await round_task
    assert result.stopped and result.records == () and outbox.samples == []


async def test_attempts_at_once_generate_together_and_keep_exactly_the_one_at_a_time_samples(
    config_for: Callable[..., DesignerConfig],
    outbox: RecordingOutbox,
    memory: MemoryServiceEnvironments,
    memory_service: MemoryService,
    documents: CorpusSampler,
) -> None:
    from services.designer.wiring import designer_seeds

    seeds = designer_seeds("spec-a")
    # Attempt 0 is malformed and the slowest to generate; 1 and 2 are valid and done first. All three
    # are in flight at once, yet 1 is finished only after 0 (attempt order) and fills the slot: 2 is
    # discarded, as the one-at-a-time loop would never have made it.
    policy = ScriptedPolicy([NO_HINT, answer("First"), answer("Second")], delays=[0.3, 0.05, 0.0])
    # No memory examples: nothing is awaited before an attempt's generation, so calls come in attempt order.
    config = config_for(max_attempts_per_env=4, attempts_at_once=3, concurrency=3, n_positive=0, n_negative=0)
    result = await make(config, policy, outbox, memory, documents, seeds=seeds).run_batch(round_index=2)

    assert policy.max_in_flight == 3 and len(policy.prompts) == 3  # no fourth attempt: the slot was filled
    finished = [(r.attempt, r.outcome) for r in result.records]
    assert finished == [(0, AttemptOutcome.MALFORMED), (1, AttemptOutcome.VALID)]
    assert result.discarded == 1
    assert [(s.outcome, s.valid) for s in outbox.samples] == [("malformed", False), ("valid", True)]
    assert [r.env_id for r in outbox.ready] == result.env_ids and "class FirstEnv" in result.records[1].code
    assert (await memory_service.stats()).attempts.attempts == 2  # the discarded one is not an attempt
    # Each attempt keeps its own seed: the samples are what attempts 0 and 1 would have generated alone.
    assert [s.seed for s in policy.samplings] == [seeds(2, 0, a, "design", 0) for a in range(3)]


async def test_an_attempt_still_generating_when_the_slot_is_filled_is_cancelled(
    config_for: Callable[..., DesignerConfig],
    outbox: RecordingOutbox,
    memory: MemoryServiceEnvironments,
    documents: CorpusSampler,
) -> None:
    policy = ScriptedPolicy([answer("Quick"), answer("Never")], delays=[0.0, float("inf")])
    config = config_for(max_attempts_per_env=2, attempts_at_once=2, concurrency=2, n_positive=0, n_negative=0)
    result = await make(config, policy, outbox, memory, documents).run_batch()
    assert policy.cancelled.is_set() and policy.in_flight == 0
    assert [r.outcome for r in result.records] == [AttemptOutcome.VALID] and result.discarded == 0
    assert not result.timed_out  # the round did not wait for the generation it no longer needed


async def test_a_slot_whose_attempts_at_once_all_fail_generates_the_next_ones(
    config_for: Callable[..., DesignerConfig],
    outbox: RecordingOutbox,
    memory: MemoryServiceEnvironments,
    documents: CorpusSampler,
) -> None:
    bad = answer("Bad", marker="fail:solution_replay")
    policy = ScriptedPolicy([bad, RuntimeError("server down"), answer("Third")])
    config = config_for(max_attempts_per_env=3, attempts_at_once=2, concurrency=4, n_positive=0, n_negative=0)
    result = await make(config, policy, outbox, memory, documents).run_batch()
    assert [(r.attempt, r.outcome) for r in result.records] == [
        (0, AttemptOutcome.INVALID),
        (1, AttemptOutcome.GENERATION_FAILED),
        (2, AttemptOutcome.VALID),
    ]
    assert result.discarded == 0 and [s.valid for s in outbox.samples] == [False, True]
