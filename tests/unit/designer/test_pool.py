"""The pool designer: answer files read as a designer writes them, rounds and skills as the policy's,
every answer through the same pipeline, samples scored and never trained (the real sandbox runs in
tests/integration/designer/test_pool_designer.py)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from services.designer.adapters import MemoryServiceEnvironments
from services.designer.core.attempt import AttemptOutcome
from services.designer.core.pipeline import AttemptPipeline, PipelineConfig
from services.designer.core.pool import DesignerPool, PoolAnswer, PoolConfig
from services.designer.pool_files import load_pool, parse_answer_file
from services.memory.service import MemoryService

from .conftest import MarkerValidator, RecordingOutbox, answer


def pool_of(
    answers: list[PoolAnswer], outbox: RecordingOutbox, memory: MemoryServiceEnvironments, **config: object
) -> DesignerPool:
    base: dict[str, object] = {"setting": "game", "envs_per_round": 4, "skills_per_round": 2, "spec_id": "spec-p"}
    base.update(config)
    pipeline = AttemptPipeline(
        PipelineConfig(setting=str(base["setting"]), spec_id="spec-p", agent_max_turns=9),
        validator=MarkerValidator(),
        memory=memory,
        outbox=outbox,
    )
    return DesignerPool(PoolConfig(**base), answers, pipeline=pipeline)  # type: ignore[arg-type]


def test_answer_files_are_read_in_name_order_with_an_optional_skill_line(tmp_path: Path) -> None:
    (tmp_path / "b.md").write_text("<!-- skill: Optimization -->\n" + answer("B"))
    (tmp_path / "a.txt").write_text(answer("A"))
    (tmp_path / "c.md").write_text("# Skill:  logical deduction \n" + answer("C"))
    (tmp_path / "README.md").write_text("what these are")
    (tmp_path / ".hidden.md").write_text(answer("H"))
    (tmp_path / "notes.json").write_text("{}")
    answers = load_pool(tmp_path)
    assert [(a.name, a.skill) for a in answers] == [
        ("a.txt", None),
        ("b.md", "Optimization"),
        ("c.md", "logical deduction"),
    ]
    assert answers[1].text == answer("B")  # the skill line is not part of the answer
    assert parse_answer_file("x.md", "# not a skill line\n```python\n").text.startswith("# not a skill line")


def test_an_empty_or_missing_pool_is_refused_with_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no answer file"):
        load_pool(tmp_path)
    with pytest.raises(ValueError, match="not a directory"):
        load_pool(tmp_path / "missing")


def test_an_answer_naming_an_unknown_skill_is_refused_at_start(
    outbox: RecordingOutbox, memory: MemoryServiceEnvironments
) -> None:
    with pytest.raises(ValueError, match=r"pool answer x\.md: unknown game skill 'Chess'"):
        pool_of([PoolAnswer("x.md", answer("X"), skill="Chess")], outbox, memory)


async def test_rounds_take_the_next_answers_with_the_rounds_skills_and_samples_are_never_trained(
    outbox: RecordingOutbox, memory: MemoryServiceEnvironments, memory_service: MemoryService
) -> None:
    answers = [PoolAnswer(f"{i}.md", answer(f"P{i}")) for i in range(6)]
    answers[1] = PoolAnswer("1.md", answer("P1"), skill="Causal Inference")
    answers[2] = PoolAnswer("2.md", "```python\nclass NoHintEnv:\n    pass\n```\n")  # malformed
    pool = pool_of(answers, outbox, memory)
    first = await pool.run_batch(weight_version=3)
    assert len(first.records) == 4 and pool.remaining == 2 and not pool.exhausted
    skills = {r.source["pool_file"]: r.skill for r in first.records}
    assert skills["1.md"] == "Causal Inference"  # named in its file
    assert Counter(skills[f"{i}.md"] for i in (0, 2, 3)) == {"Mathematical Reasoning": 2, "Logical Deduction": 1}
    outcomes = {r.source["pool_file"]: r.label for r in first.records}
    assert outcomes == {"0.md": "valid", "1.md": "valid", "2.md": "malformed", "3.md": "valid"}

    second = await pool.run_batch(weight_version=4)
    assert second.round_index == 1 and len(second.records) == 2 and pool.exhausted
    assert {r.skill for r in second.records} <= {"Spatial Reasoning", "Pattern Recognition"}
    assert (await pool.run_batch()).records == ()  # spent: an empty round

    assert len(outbox.samples) == 6 and not any(s.trainable for s in outbox.samples)
    assert all(s.spec_id == "spec-p" and s.output_ids == () for s in outbox.samples)
    assert {s.batch_id for s in outbox.samples} == {first.batch_id, second.batch_id}
    assert len(outbox.ready) == 5 and {r.weight_version for r in outbox.ready} == {3, 4}
    env = await memory_service.get_environment(outbox.ready[0].env_id)
    assert env.corpus_ref.endswith(".md")  # the answer's file is its source
    attempts = (await memory_service.stats()).attempts
    assert attempts.by_outcome == {"valid": 5, "malformed": 1}


async def test_a_duplicate_answer_is_a_duplicate_attempt(
    outbox: RecordingOutbox, memory: MemoryServiceEnvironments
) -> None:
    pool = pool_of(
        [PoolAnswer("a.md", answer("Same")), PoolAnswer("b.md", answer("Same"))], outbox, memory, concurrency=1
    )
    result = await pool.run_batch()
    assert sorted(r.outcome.value for r in result.records) == ["duplicate", "valid"]
    assert [r.outcome for r in result.records if r.outcome is AttemptOutcome.DUPLICATE]


FIXTURES = Path(__file__).parents[2] / "fixtures" / "designer_pool"


@pytest.mark.parametrize("setting", ["game", "tool"])
def test_the_shipped_valid_answers_are_the_contracts_examples_exactly(setting: str, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from services.designer.cli import designer as designer_cli

    result = CliRunner().invoke(designer_cli, ["example-pool", str(tmp_path), "--setting", setting])
    assert result.exit_code == 0, result.output
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == sorted(p.name for p in (FIXTURES / setting).glob("valid-*.md"))
    for name in written:  # the fixtures cannot drift from spade.envs.examples
        assert (tmp_path / name).read_text() == (FIXTURES / setting / name).read_text(), name
    assert all(a.skill for a in load_pool(tmp_path))
