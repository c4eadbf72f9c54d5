"""``spade run`` end to end: two steps of the whole loop with the real model, sandbox and learner."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from services.embedded.runner import run
from services.embedded.settings import RunSettings
from spade.inference.models import ensure_default_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    run_dir = tmp_path_factory.mktemp("run")
    settings = RunSettings(
        run_dir=run_dir,
        steps=2,
        envs_per_step=1,
        designer_attempts=2,
        designer_max_new_tokens=64,
        designer_max_prompt_tokens=1536,
        group_size=8,
        agent_max_turns=3,
        agent_max_tokens_per_turn=12,
        lr=1e-4,
        temperature=1.0,
    )
    result = asyncio.run(run(settings))
    return run_dir, result


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    return tensors


def test_designer_attempts_are_validated_or_rejected_with_a_reason(finished_run: tuple[Path, object]) -> None:
    run_dir, _ = finished_run
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["designer/attempts"] >= 1 for r in records)
    designed = [json.loads(line) for line in (run_dir / "envs.jsonl").read_text().splitlines()]
    for env in designed:
        if env["corpus_ref"].startswith("seed pool"):
            assert env["status"] in ("valid", "retired")
        elif env["status"] == "invalid":
            assert env["failed_check"], f"invalid env {env['env_id']} has no failing check named"


def test_both_arms_play_the_same_seeds_the_same_number_of_times(finished_run: tuple[Path, object]) -> None:
    run_dir, _ = finished_run
    with sqlite3.connect(run_dir / "memory.db") as db:
        rows = db.execute("SELECT env_id, seed, hinted, weight_version FROM plays").fetchall()
        first = dict(db.execute("SELECT id, weight_version FROM environments").fetchall())
    arms: dict[tuple[str, bool], list[int]] = defaultdict(list)
    for env_id, seed, hinted, version in rows:
        if version == first[env_id]:
            arms[(env_id, bool(hinted))].append(seed)
    played = {env_id for env_id, _ in arms}
    assert played, "no env was played at its first version"
    for env_id in played:
        assert sorted(arms[(env_id, False)]) == sorted(arms[(env_id, True)]), env_id
        assert len(arms[(env_id, False)]) == 8


def test_rewards_computed_parameters_changed_and_weights_published(finished_run: tuple[Path, object]) -> None:
    run_dir, result = finished_run
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["agent/reward_mean"] is not None
    assert records[0]["learner/trained"], records[0]
    assert records[1]["agent/plays"] > 0, "the seed pool must stay active for the whole run"
    assert records[0]["learner/logp_diff_mean"] < 0.05, "rollout and learner logprobs disagree"
    assert records[-1]["designer/scored"] >= 1, "no designer sample was scored when its window closed"
    assert records[-1]["designer/reward_mean"] is not None
    assert int(records[-1]["inference/weight_version"]) >= 1
    base = _weights(ensure_default_model())
    trained = _weights(run_dir / "last_checkpoint" / "model")
    changed = [name for name in base if not torch.equal(base[name], trained[name])]
    assert len(changed) > len(base) // 2, f"only {len(changed)} of {len(base)} tensors changed"
    assert result.report is not None and result.report.exists()  # type: ignore[attr-defined]
    page = result.report.read_text()  # type: ignore[attr-defined]
    assert "Agent win rate" in page and "<svg" in page
