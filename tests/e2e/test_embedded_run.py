"""``spade run`` end to end with the real model, sandbox, memory and learner, seeded (no luck needed):
the policy's own loop (designer, seed pool, rollout, learner, held-out evaluation, report).

The other runs (``--designer-pool``; ``--designer off`` under the no-idle rule) have their own modules,
so that ``make test``'s workers run them side by side; tests/e2e/embedded_runs.py holds what they
share and why their plays are the same on every run.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch

from services.embedded.report import chart_ids
from services.embedded.runner import RunResult, run
from services.embedded.settings import RunSettings
from spade.cpu_linear import native_bf16
from spade.inference.models import ensure_default_model
from spade.runspec import RunSpec
from tests.e2e.embedded_runs import TRAINING, G, lines, stored_plays, weights

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]


# --- the policy's own loop -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def policy_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, RunResult]:
    run_dir = tmp_path_factory.mktemp("run")
    settings = RunSettings(
        run_dir=run_dir,
        steps=2,
        envs_per_step=1,
        designer_attempts=2,
        designer_max_new_tokens=64,
        pool_envs_per_step=1,  # one seed-pool env a step beside the designed one: half the plays to train on
        lr=1e-4,
        **{**TRAINING, "held_out_eval": True, "eval_limit": 4, "eval_difficulties": 1},  # type: ignore[arg-type]
    )
    return run_dir, asyncio.run(run(settings))


def _steps(run_dir: Path) -> list[dict[str, Any]]:
    """The steps' lines of ``metrics.jsonl`` (step 0 is the evaluation before the first step)."""
    return [r for r in lines(run_dir / "metrics.jsonl") if r["step"]]


def test_designer_attempts_are_counted_by_outcome_each_step(policy_run: tuple[Path, RunResult]) -> None:
    run_dir, result = policy_run
    records = _steps(run_dir)
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["spec_id"] == result.spec_id == RunSpec.from_json((run_dir / "run_spec.json").read_text()).spec_id
        outcomes = {k: v for k, v in r.items() if k.startswith("designer/outcome/")}
        assert r["designer/attempts"] >= 1 and sum(outcomes.values()) == r["designer/attempts"], outcomes
    assert records[-1]["designer/total/attempts"] == sum(r["designer/attempts"] for r in records)
    for env in lines(run_dir / "envs.jsonl"):
        if env["source"] == "seed pool":  # the audit may retire an easy graded env by chance (docs/rollout.md)
            assert env["status"] in ("valid", "retired", "trivially_won")
        elif env["status"] == "invalid":
            assert env["failed_check"], f"invalid env {env['env_id']} has no failing check named"


def test_both_arms_play_the_same_seeds_at_slot_0(policy_run: tuple[Path, RunResult]) -> None:
    run_dir, _ = policy_run
    arms: dict[tuple[str, bool], list[int]] = defaultdict(list)
    for env_id, seed, hinted, _, slot, _ in stored_plays(run_dir):
        if slot == 0:
            arms[(env_id, bool(hinted))].append(seed)
    played = {env_id for env_id, _ in arms}
    assert played, "no env was played at slot 0"
    for env_id in played:
        assert sorted(arms[(env_id, False)]) == sorted(arms[(env_id, True)]), env_id
        assert len(arms[(env_id, False)]) in (G, 2 * G)  # extended


def test_agent_figures_pool_metrics_and_the_learner_s_step(policy_run: tuple[Path, RunResult]) -> None:
    run_dir, result = policy_run
    records = _steps(run_dir)
    first = records[0]
    returns = [ret for _, _, hinted, ret, _, _ in stored_plays(run_dir) if not hinted]
    assert first["agent/win_rate"] is not None and 0.0 <= first["agent/win_rate"] <= 1.0
    assert 0.0 <= first["agent/solved_fraction"] <= 1.0 and returns
    assert first["learner/trained"], first
    assert records[1]["agent/plays"] > 0, "the seed pool must stay active for the whole run"
    assert first["pool/chosen_this_step"] > 0, "step 1 plays pool envs besides its designed ones"
    assert first["learner/logp_diff_mean"] < 0.05, "rollout and learner logprobs disagree"
    # Step 1 plays on the weights it trains: the logprobs differ only by the learner's arithmetic, fp32
    # rounding (~1e-6), or bf16 products where the CPU has them (the run's default there, roles.py).
    assert (first["learner/logp_diff_mean"] > 1e-4) is native_bf16(), first["learner/logp_diff_mean"]
    assert first["pool/envs"] >= 5 and first["pool/hash_distinct"] >= 5 and first["pool/probed"] >= 5
    assert first["time/rollout_s"] > 0 and first["work/rollout_generation_tokens"] > 0
    assert first["time/rollout_generation_busy_s"] > 0
    # The server's own busy time: something, and never more than the step's wall time (overlapping
    # requests do not add up there, unlike the components' busy time).
    wall = sum(first.get(f"time/{phase}_s", 0.0) for phase in ("designer", "rollout", "learner", "stats", "eval"))
    assert 0 < first["time/inference_busy_s"] <= wall
    # Each figure is rounded to the millisecond, so their sum may pass the total by one rounding step.
    parts = first["time/inference_prefill_s"] + first["time/inference_decode_s"]
    assert parts <= first["time/inference_busy_s"] + 0.0015
    # The server's own tokens: at least what the rollout's plays generated, and prompts it computed.
    assert first["work/inference_generated_tokens"] >= first["work/rollout_generation_tokens"] > 0
    assert first["work/inference_prompt_tokens"] > 0 and first["work/inference_cached_tokens"] >= 0
    assert 0 < first["work/inference_prefill_passes"] <= first["work/inference_prefills"]
    assert first["work/inference_decode_rows"] >= first["work/inference_decode_steps"] > 0
    assert not [k for k in first if k.startswith("time/") and not k.endswith("_s")], "time/ holds seconds only"
    assert int(records[-1]["inference/weight_version"]) == result.weight_version == 2
    base = weights(ensure_default_model())
    trained = weights(run_dir / "last_checkpoint" / "model")
    changed = [name for name in base if not torch.equal(base[name], trained[name])]
    assert len(changed) > len(base) // 2, f"only {len(changed)} of {len(base)} tensors changed"
    page = (run_dir / "report.html").read_text()
    assert all(f'data-chart="{chart}"' in page for chart in chart_ids())
    assert 'id="summary"' in page and f"seed pool ({len(result.seeded)} envs)" in page and result.spec_id in page
    assert "Departures from the paper" in page and "seed_pool = True" in page
    assert "<tr><th>served weights</th><td>float32</td></tr>" in page  # what the server decoded from (pinned)


def test_each_step_trains_beside_the_next_steps_generation_and_publishes_after_it(
    policy_run: tuple[Path, RunResult],
) -> None:
    run_dir, result = policy_run
    first, second = _steps(run_dir)
    # Step 1 trained while step 2 generated; its weights could not reach the server before that
    # generation was done (held when the training ended first: how long depends on the machine's load),
    # so every play of the run (steps 1 and 2) was generated under version 0 ...
    assert first["learner/trained"] and first["time/learner_overlapped_s"] > 0
    assert first["time/learner_publish_held_s"] >= 0
    with sqlite3.connect(run_dir / "memory.db") as db:
        versions = {v for (v,) in db.execute("SELECT DISTINCT weight_version FROM plays")}
        designed = {v for (v,) in db.execute("SELECT DISTINCT weight_version FROM designer_attempts")}
    assert versions == {0} and designed == {0}, (versions, designed)  # the version served, not the learner's
    # ... one version behind the learner at step 2, as the staleness figures say; the last step is
    # waited for (nothing to overlap) and its weights are the ones served at the end.
    assert first["learner/staleness/agent_max"] == 0 and second["learner/staleness/agent_max"] == 1
    assert second["time/learner_overlapped_s"] < 1 and second["time/learner_s"] >= second["time/learner_train_s"]
    assert int(second["inference/weight_version"]) == result.weight_version == 2


def test_held_out_families_are_scored_before_the_first_step_and_after_the_last(
    policy_run: tuple[Path, RunResult],
) -> None:
    from spade.envs.families import held_out_families

    run_dir, result = policy_run
    held_out = {f.name for f in held_out_families("game")}
    pool = lines(run_dir / "eval" / "pool.jsonl")
    assert pool and {row["corpus_ref"].removeprefix("held-out family: ") for row in pool} <= held_out
    trained_on = {e["corpus_ref"] for e in lines(run_dir / "envs.jsonl")}
    assert not any(f.name in ref for f in held_out_families("game") for ref in trained_on if "seed pool" in ref)
    assert (run_dir / "eval" / "step-0000").is_dir() and (run_dir / "eval" / "step-0002").is_dir()
    assert result.held_out is not None and result.held_out["n"] == 4
    assert result.held_out["low"] <= result.held_out["mean"] <= result.held_out["high"]
    assert result.held_out["mean"] == pytest.approx(result.held_out["after"] - result.held_out["before"])
    page = (run_dir / "report.html").read_text()
    summary = page[page.index('id="summary"') :]
    assert summary.index("On held-out envs (4 paired items)") < summary.index("designer")
