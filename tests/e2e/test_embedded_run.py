"""``spade run`` end to end with the real model, sandbox, memory and learner, seeded (no luck needed).

Three runs, each as small as it can be while still showing what it tests:

- the policy's own loop (designer, seed pool, rollout, learner, report);
- ``--designer-pool`` over a handful of valid and invalid answers: every valid env is played on the
  same seeds in both arms, its designer sample gets the regret, plateau and blend this test recomputes
  from the stored plays with ``spade.signal``, and some designer advantage is nonzero;
- ``--designer off --pool DIR``: only the agent is trained (no designer sample, agent samples yes).

Every generation carries a seed derived from the run, env, version, seed, arm and turn (the rollout's
``sampling_seed``), env ids are content addresses of the env's code (so the seeds a play gets are
the same on every run), and so the plays, and with them every assertion below, are the same on every
run up to the float sums of the server's batch shapes. Before env ids were content addresses they
were random, so every run played other seeds and samples: the ``--designer off`` run trained or not
by luck (CI saw both of its groups all 0, once at G = 4 and once at G = 8).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sqlite3
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from services.embedded.report import chart_ids
from services.embedded.runner import RunResult, run
from services.embedded.settings import RunSettings
from spade import signal
from spade.envs.types import FinishReason
from spade.inference.models import ensure_default_model
from spade.runspec import RunSpec

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "designer_pool" / "game"
POOL_ANSWERS = ("valid-number_hunt.md", "valid-code_breaker.md", "invalid-smoke.md", "invalid-determinism.md")
SMALL = {
    "group_size": 4,
    "agent_max_turns": 3,
    # Long enough for NumberHunt's guess in most replies: its graded returns then differ across seeds,
    # so the policy run's first step has a group with variance to train on (at 12 tokens nearly every
    # return was 0).
    "agent_max_tokens_per_turn": 16,
    "designer_max_prompt_tokens": 1536,
    "temperature": 1.0,
}


# Runs that must train: 8 seeds per group, so that a group of NumberHunt's graded returns has spread
# (a group without variance trains nothing). The plays are the same on every run (see the docstring).
TRAINING = {**SMALL, "group_size": 8}


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    return tensors


def _plays(run_dir: Path) -> list[tuple[str, int, bool, float, int, str]]:
    with sqlite3.connect(run_dir / "memory.db") as db:
        return db.execute(
            "SELECT env_id, seed, hinted, episode_return, window_index, finish_reason FROM plays"
        ).fetchall()


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
        lr=1e-4,
        **TRAINING,  # type: ignore[arg-type]
    )
    return run_dir, asyncio.run(run(settings))


def test_designer_attempts_are_counted_by_outcome_each_step(policy_run: tuple[Path, RunResult]) -> None:
    run_dir, result = policy_run
    records = _lines(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["spec_id"] == result.spec_id == RunSpec.from_json((run_dir / "run_spec.json").read_text()).spec_id
        outcomes = {k: v for k, v in r.items() if k.startswith("designer/outcome/")}
        assert r["designer/attempts"] >= 1 and sum(outcomes.values()) == r["designer/attempts"], outcomes
    assert records[-1]["designer/total/attempts"] == sum(r["designer/attempts"] for r in records)
    for env in _lines(run_dir / "envs.jsonl"):
        if env["source"] == "seed pool":
            assert env["status"] in ("valid", "retired")
        elif env["status"] == "invalid":
            assert env["failed_check"], f"invalid env {env['env_id']} has no failing check named"


def test_both_arms_play_the_same_seeds_at_slot_0(policy_run: tuple[Path, RunResult]) -> None:
    run_dir, _ = policy_run
    arms: dict[tuple[str, bool], list[int]] = defaultdict(list)
    for env_id, seed, hinted, _, slot, _ in _plays(run_dir):
        if slot == 0:
            arms[(env_id, bool(hinted))].append(seed)
    played = {env_id for env_id, _ in arms}
    assert played, "no env was played at slot 0"
    for env_id in played:
        assert sorted(arms[(env_id, False)]) == sorted(arms[(env_id, True)]), env_id
        assert len(arms[(env_id, False)]) == TRAINING["group_size"]


def test_agent_figures_pool_metrics_and_the_learner_s_step(policy_run: tuple[Path, RunResult]) -> None:
    run_dir, result = policy_run
    records = _lines(run_dir / "metrics.jsonl")
    first = records[0]
    returns = [ret for _, _, hinted, ret, _, _ in _plays(run_dir) if not hinted]
    assert first["agent/win_rate"] is not None and 0.0 <= first["agent/win_rate"] <= 1.0
    assert 0.0 <= first["agent/solved_fraction"] <= 1.0 and returns
    assert first["learner/trained"], first
    assert records[1]["agent/plays"] > 0, "the seed pool must stay active for the whole run"
    assert first["learner/logp_diff_mean"] < 0.05, "rollout and learner logprobs disagree"
    assert first["pool/envs"] >= 5 and first["pool/hash_distinct"] >= 5 and first["pool/probed"] >= 5
    assert first["time/rollout_s"] > 0 and first["work/rollout_generation_tokens"] > 0
    assert first["time/rollout_generation_busy_s"] > 0
    # The server's own busy time: something, and never more than the step's wall time (overlapping
    # requests do not add up there, unlike the components' busy time).
    wall = sum(first.get(f"time/{phase}_s", 0.0) for phase in ("designer", "rollout", "learner", "stats", "eval"))
    assert 0 < first["time/inference_busy_s"] <= wall
    assert first["time/inference_prefill_s"] + first["time/inference_decode_s"] <= first["time/inference_busy_s"]
    assert not [k for k in first if k.startswith("time/") and not k.endswith("_s")], "time/ holds seconds only"
    assert int(records[-1]["inference/weight_version"]) == result.weight_version == 2
    base = _weights(ensure_default_model())
    trained = _weights(run_dir / "last_checkpoint" / "model")
    changed = [name for name in base if not torch.equal(base[name], trained[name])]
    assert len(changed) > len(base) // 2, f"only {len(changed)} of {len(base)} tensors changed"
    page = (run_dir / "report.html").read_text()
    assert all(f'data-chart="{chart}"' in page for chart in chart_ids())
    assert 'id="summary"' in page and "seed pool (5 example envs)" in page and result.spec_id in page
    assert "Departures from the paper" in page and "seed_pool = True" in page


# --- the pool designer ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pool_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, RunResult]:
    answers = tmp_path_factory.mktemp("answers")
    for name in POOL_ANSWERS:
        shutil.copy(FIXTURES / name, answers / name)
    run_dir = tmp_path_factory.mktemp("pool-run")
    settings = RunSettings(
        run_dir=run_dir,
        steps=2,
        envs_per_step=len(POOL_ANSWERS),
        skills_per_round=1,
        regenerate_every=2,  # one round: every answer in round 0
        window_versions=1,
        seed_pool=False,
        designer_pool=answers,
        **SMALL,  # type: ignore[arg-type]
    )
    return run_dir, asyncio.run(run(settings))


def test_every_valid_answer_is_played_on_the_same_seeds_in_both_arms(pool_run: tuple[Path, RunResult]) -> None:
    run_dir, _ = pool_run
    envs = {e["env_id"]: e for e in _lines(run_dir / "envs.jsonl")}
    valid = [env_id for env_id, e in envs.items() if e["status"] in ("valid", "retired")]
    assert len(valid) == 2, envs
    arms: dict[tuple[str, bool], list[int]] = defaultdict(list)
    for env_id, seed, hinted, _, slot, _ in _plays(run_dir):
        if slot == 0:
            arms[(env_id, bool(hinted))].append(seed)
    for env_id in valid:
        assert len(arms[(env_id, True)]) == SMALL["group_size"]
        assert sorted(arms[(env_id, True)]) == sorted(arms[(env_id, False)])
    invalid = {e["failed_check"] for e in envs.values() if e["status"] == "invalid"}
    assert invalid == {"smoke", "determinism"}


def test_each_designer_sample_gets_the_reward_recomputed_from_its_plays(pool_run: tuple[Path, RunResult]) -> None:
    run_dir, _ = pool_run
    spec = RunSpec.from_json((run_dir / "run_spec.json").read_text())
    config = spec.rewards.to_config()
    rows = _lines(run_dir / "designer_rewards.jsonl")
    assert len(rows) == len(POOL_ANSWERS) and not any(r["trainable"] for r in rows)  # scored, never trained
    plays = _plays(run_dir)
    valid_rows = [r for r in rows if r["valid"]]
    assert {r["outcome"] for r in rows} == {"valid", "smoke", "determinism"} and len(valid_rows) == 2
    for row in valid_rows:
        mine = [p for p in plays if p[0] == row["env_id"]]
        hinted = [(seed, ret) for _, seed, h, ret, slot, _ in mine if h and slot == 0]
        unhinted = [(seed, ret) for _, seed, h, ret, slot, _ in mine if not h and slot == 0]
        window = [
            0.0 if FinishReason(reason).is_resource_fault else ret
            for _, _, h, ret, slot, reason in mine
            if not h and slot < spec.window_versions_game
        ]
        regret = signal.regret(hinted, unhinted)
        rate = signal.win_rate(window)
        expected = signal.designer_blend(regret, rate, config=config)
        assert row["regret"] == pytest.approx(regret, abs=1e-9)
        assert row["window_win_rate"] == pytest.approx(rate, abs=1e-9)
        assert row["plateau"] == pytest.approx(signal.plateau(rate, config.band), abs=1e-9)
        assert row["blend"] == pytest.approx(expected.blend, abs=1e-9)
    for row in rows:
        if not row["valid"]:
            shaping = spec.rewards.validity_shaping_weight * (row["validity_fraction"] or 0.0)
            assert row["blend"] == pytest.approx(shaping)
    records = _lines(run_dir / "metrics.jsonl")
    assert max(r.get("designer/advantage_nonzero_frac") or 0.0 for r in records) > 0.0
    assert sum(r.get("designer/scored") or 0 for r in records) == len(POOL_ANSWERS)
    assert "pool designer (answers from files)" in (run_dir / "report.html").read_text()


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
    (record,) = _lines(run_dir / "metrics.jsonl")
    assert record["designer/ran"] is False and not (run_dir / "designer_rewards.jsonl").exists()
    assert not record.get("learner/count/designer_received") and not record.get("designer/scored")
    assert record["learner/count/agent_received"] > 0 and record["learner/trained"]
    assert record["designer/total/attempts"] == 0
    assert len(result.static) == 2
    envs = _lines(run_dir / "envs.jsonl")
    assert {e["source"] for e in envs} == {"static pool"} and len(envs) == 2
    assert {p[0] for p in _plays(run_dir)} == {e["env_id"] for e in envs}
    assert "The designer was off" in (run_dir / "report.html").read_text()
