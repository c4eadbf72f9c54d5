"""``spade run --designer off --pool DIR`` end to end: only the agent is trained (no designer sample,
agent samples yes), on a static pool of a designer answer, an env file with its hint and a broken env
that validation leaves out.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from services.embedded.runner import RunResult, run
from services.embedded.settings import RunSettings
from tests.e2e.embedded_runs import FIXTURES, TRAINING, lines, stored_plays

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]


# --- the designer off -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def agent_only_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, RunResult]:
    from spade.envs.examples import EXAMPLES

    pool = tmp_path_factory.mktemp("static-pool")
    shutil.copy(FIXTURES / "valid-number_hunt.md", pool / "number_hunt.md")  # a designer answer
    example = EXAMPLES["code_breaker"]
    (pool / "code_breaker.py").write_text(f"# skill: {example.skill}\n{example.code}")  # env code + hint file
    (pool / "code_breaker.hint").write_text(example.hint)
    (pool / "broken.py").write_text("class BrokenEnv:\n    pass\n")  # fails validation: left out, named
    run_dir = tmp_path_factory.mktemp("agent-only")
    settings = RunSettings(
        run_dir=run_dir,
        steps=1,
        designer_mode="off",
        pool=pool,
        seed_pool=False,
        lr=1e-4,
        **TRAINING,  # type: ignore[arg-type]
    )
    return run_dir, asyncio.run(run(settings))


def test_designer_off_trains_only_the_agent(agent_only_run: tuple[Path, RunResult]) -> None:
    run_dir, result = agent_only_run
    (record,) = lines(run_dir / "metrics.jsonl")
    assert record["designer/ran"] is False and not (run_dir / "designer_rewards.jsonl").exists()
    assert not record.get("learner/count/designer_received") and not record.get("designer/scored")
    assert record["learner/count/agent_received"] > 0 and record["learner/trained"]
    assert record["designer/total/attempts"] == 0
    assert len(result.static) == 2
    envs = lines(run_dir / "envs.jsonl")
    assert {e["source"] for e in envs} == {"static pool"} and len(envs) == 2
    assert {p[0] for p in stored_plays(run_dir)} == {e["env_id"] for e in envs}
    assert "The designer was off" in (run_dir / "report.html").read_text()
