"""``spade run --designer-pool`` end to end over a handful of valid and invalid answers: every valid env
is played on the same seeds in both arms, its designer sample gets the regret, plateau and blend this
test recomputes from the stored plays with ``spade.signal``, and some designer advantage is nonzero.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sqlite3
from collections import defaultdict
from pathlib import Path

import pytest

from services.embedded.runner import RunResult, run
from services.embedded.settings import RunSettings
from spade import signal
from spade.envs.types import FinishReason
from spade.runspec import RunSpec
from tests.e2e.embedded_runs import FIXTURES, SMALL, lines, stored_plays

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]


POOL_ANSWERS = ("valid-number_hunt.md", "valid-code_breaker.md", "invalid-smoke.md", "invalid-determinism.md")


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
    envs = {e["env_id"]: e for e in lines(run_dir / "envs.jsonl")}
    valid = [env_id for env_id, e in envs.items() if e["status"] in ("valid", "retired")]
    assert len(valid) == 2, envs
    arms: dict[tuple[str, bool], list[int]] = defaultdict(list)
    for env_id, seed, hinted, _, slot, _ in stored_plays(run_dir):
        if slot == 0:
            arms[(env_id, bool(hinted))].append(seed)
    for env_id in valid:
        small = 4  # SMALL["group_size"]: G, or 2G when the rollout extended a group without variance
        assert len(arms[(env_id, True)]) in (small, 2 * small)
        assert sorted(arms[(env_id, True)]) == sorted(arms[(env_id, False)])
    invalid = {e["failed_check"] for e in envs.values() if e["status"] == "invalid"}
    assert invalid == {"smoke", "determinism"}


def test_each_designer_sample_gets_the_reward_recomputed_from_its_plays(pool_run: tuple[Path, RunResult]) -> None:
    run_dir, _ = pool_run
    spec = RunSpec.from_json((run_dir / "run_spec.json").read_text())
    config = spec.rewards.to_config()
    rows = lines(run_dir / "designer_rewards.jsonl")
    assert len(rows) == len(POOL_ANSWERS) and not any(r["trainable"] for r in rows)  # scored, never trained
    plays = stored_plays(run_dir)
    with sqlite3.connect(run_dir / "rollout.db") as db:  # each env's audit verdict, as the rollout kept it
        verdicts = [json.loads(v) for (v,) in db.execute("SELECT verdict FROM rollout_audits").fetchall()]
    audited = {v["env_id"]: max(signal.win_rate(r["returns"]) for r in v["results"]) for v in verdicts}
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
        trivial = audited[row["env_id"]]  # the plateau is taken of the win rate above the audit's
        expected = signal.designer_blend(regret, rate, config=config, trivial_win_rate=trivial)
        assert row["regret"] == pytest.approx(regret, abs=1e-9)
        assert row["window_win_rate"] == pytest.approx(rate, abs=1e-9)
        assert row["trivial_win_rate"] == pytest.approx(trivial, abs=1e-9)
        corrected = signal.chance_corrected(rate, trivial)
        assert row["plateau"] == pytest.approx(signal.plateau(corrected, config.band), abs=1e-9)
        assert row["blend"] == pytest.approx(expected.blend, abs=1e-9)
    for row in rows:
        if not row["valid"]:
            shaping = signal.shaping_penalty(row["validity_fraction"], spec.rewards.validity_shaping_weight)
            assert row["blend"] == pytest.approx(shaping) and row["blend"] <= 0.0
    records = lines(run_dir / "metrics.jsonl")
    assert max(r.get("designer/advantage_nonzero_frac") or 0.0 for r in records) > 0.0
    assert sum(r.get("designer/scored") or 0 for r in records) == len(POOL_ANSWERS)
    assert "pool designer (answers from files)" in (run_dir / "report.html").read_text()
