"""``spade run --designer off --pool DIR`` end to end: only the agent is trained, on a static pool of an
env file with its hint, a designer answer and a broken env that validation leaves out; and the no-idle
rule: a step whose only env has no variance is extended, does not train and says why; the next step
plays another env and trains.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from services.embedded.runner import RunResult, run
from services.embedded.settings import RunSettings
from spade.inference.answer_format import designer_answer
from tests.e2e.embedded_runs import FIXTURES, TRAINING, G, lines, stored_plays

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]


# --- the no-idle rule ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def idle_first_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, RunResult]:
    """The designer off; step 1 can only play an env no play of which ever wins (zero variance); step 2
    must play another."""
    from spade.envs.families import FAMILIES

    pool = tmp_path_factory.mktemp("no-signal-pool")
    for name in ("a_secret_word.py", "a_secret_word.hint"):
        shutil.copy(FIXTURES.parents[1] / "no_signal" / name, pool / name)
    graded = FAMILIES["add"].generate(0.1)
    (pool / "b_add.md").write_text(f"# skill: {graded.skill}\n{designer_answer(graded.code, graded.hint)}")
    (pool / "c_broken.py").write_text("class BrokenEnv:\n    pass\n")  # fails validation: left out, named
    run_dir = tmp_path_factory.mktemp("idle-first")
    settings = RunSettings(
        run_dir=run_dir,
        steps=2,
        designer_mode="off",
        pool=pool,
        seed_pool=False,
        pool_envs_per_step=1,  # one env a step, in pool order first: the secret word, then the graded sum
        lr=1e-4,
        overlap_learner=False,  # the sequential loop (tests/e2e/test_embedded_run.py runs the overlapped one)
        **TRAINING,  # type: ignore[arg-type]
    )
    return run_dir, asyncio.run(run(settings))


def test_a_run_whose_first_step_has_no_variance_still_plays_and_trains_later(
    idle_first_run: tuple[Path, RunResult],
) -> None:
    run_dir, result = idle_first_run
    first, second = lines(run_dir / "metrics.jsonl")
    envs = {e["env_class"]: e["env_id"] for e in lines(run_dir / "envs.jsonl")}
    secret = envs["SecretWordEnv"]
    plays = stored_plays(run_dir)
    unhinted = [ret for env, _, hinted, ret, _, _ in plays if env == secret and not hinted]
    # The group had no variance, so the rollout extended it once with G fresh seeds: still all 0.
    assert len(unhinted) == 2 * G and set(unhinted) == {0.0}
    assert first["agent/plays"] > 0 and not first["learner/trained"]
    assert "zero variance" in first["learner/why_not_trained"]
    # No step played nothing while the pool held valid envs: step 2 played the other env, and trained.
    assert all(r["agent/plays"] > 0 for r in (first, second))
    assert {env for env, *_ in plays} == set(envs.values())
    assert second["learner/trained"] and second["learner/count/agent_groups"] >= 1
    assert result.weight_version == 1
    page = (run_dir / "report.html").read_text()
    assert "learner trained in 1 of 2 steps" in page.replace("The learner", "learner")


def test_designer_off_trains_only_the_agent_on_the_valid_envs_of_its_pool(
    idle_first_run: tuple[Path, RunResult],
) -> None:
    run_dir, result = idle_first_run
    records = lines(run_dir / "metrics.jsonl")
    assert not (run_dir / "designer_rewards.jsonl").exists()
    for record in records:
        assert record["designer/ran"] is False and record["designer/total/attempts"] == 0
        assert not record.get("learner/count/designer_received") and not record.get("designer/scored")
    assert records[-1]["learner/count/agent_received"] > 0
    # Sequential: nothing of a learner step ran beside generation, and no play was behind the learner.
    assert not any("time/learner_overlapped_s" in r for r in records)
    assert all(not r.get("learner/staleness/agent_max") for r in records)
    assert len(result.static) == 2  # the broken env is left out
    envs = lines(run_dir / "envs.jsonl")
    assert {e["source"] for e in envs} == {"static pool"} and len(envs) == 2
    assert "BrokenEnv" not in {e["env_class"] for e in envs}
    assert "The designer was off" in (run_dir / "report.html").read_text()
