"""The warm start's cache: its key follows the families' code and the training settings (not the
evaluation's), a finished warm start is reused, and a build lands atomically."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import spade.envs.families as families_package
from services.embedded.warmstart import cache
from services.embedded.warmstart.cache import RECORD, cache_key, ensure_warm_start, families_digest, read_record
from services.embedded.warmstart.settings import WarmStartSettings
from spade.cpu_linear import native_bf16

DIGESTS = {"model": "m", "families": "f", "sources": "s", "corpus": "c"}


def test_the_key_changes_when_the_families_code_changes(tmp_path: Path) -> None:
    copy = tmp_path / "families"
    shutil.copytree(Path(families_package.__file__).parent, copy, ignore=shutil.ignore_patterns("__pycache__"))
    before = families_digest(copy)
    assert before == families_digest()  # the copy is the installed families' code
    numbers = copy / "numbers.py"
    numbers.write_text(numbers.read_text().replace("+", "-", 1))
    after = families_digest(copy)
    assert after != before
    settings = WarmStartSettings()
    assert cache_key(settings, **{**DIGESTS, "families": before}) != cache_key(
        settings, **{**DIGESTS, "families": after}
    )
    (copy / "extra.py").write_text("x = 1\n")  # a new family module counts too
    assert families_digest(copy) != after


def test_the_key_covers_training_settings_but_not_the_evaluation() -> None:
    base = WarmStartSettings()
    key = cache_key(base, **DIGESTS)
    for change in ({"pairs": 7}, {"epochs": 4}, {"lr": 3e-5}, {"max_prompt_tokens": 2048}, {"agent_max_turns": 5}):
        assert cache_key(base.model_copy(update=change), **DIGESTS) != key, change
    for same in (
        {"evaluate": False},
        {"eval_base": False},
        {"eval_prompts": 2},
        {"torch_threads": 1},
        {"temperature": 1.0},
    ):
        assert cache_key(base.model_copy(update=same), **DIGESTS) == key, same
    for digest in DIGESTS:
        assert cache_key(base, **{**DIGESTS, digest: "other"}) != key, digest


def test_the_key_says_whether_the_sft_multiplied_in_bf16() -> None:
    keys = {told: cache_key(WarmStartSettings(cpu_bf16=told), **DIGESTS) for told in (False, True)}
    assert keys[False] != keys[True]
    assert WarmStartSettings().cpu_bf16 is native_bf16()  # by default: what this CPU does best
    assert cache_key(WarmStartSettings(), **DIGESTS) == keys[native_bf16()]


def test_a_finished_warm_start_is_reused_and_force_rebuilds_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "SmolLM2-135M-Instruct-warm-abc"
    monkeypatch.setattr(cache, "warm_start_dir", lambda settings: target)
    builds: list[Path] = []

    async def build(settings: WarmStartSettings, staging: Path, progress: object) -> dict[str, object]:
        builds.append(staging)
        assert staging.parent == target.parent and staging != target  # built beside the target, then renamed
        (staging / "model.safetensors").write_text("weights")
        return {"pairs": {"valid": 1}, "evaluation": {"before": {}, "after": {}}}

    monkeypatch.setattr("services.embedded.warmstart.build.build", build)
    settings = WarmStartSettings(evaluate=False)
    assert ensure_warm_start(settings) == target
    assert (target / "model.safetensors").read_text() == "weights"
    assert read_record(target)["directory"] == str(target)  # type: ignore[index]
    assert ensure_warm_start(settings) == target and len(builds) == 1  # cached
    assert ensure_warm_start(settings, force=True) == target and len(builds) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [target.name]  # no staging or old copy left


def test_a_directory_without_its_record_is_not_a_warm_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "half-written"
    (target).mkdir()
    (target / "model.safetensors").write_text("partial")
    monkeypatch.setattr(cache, "warm_start_dir", lambda settings: target)

    async def build(settings: WarmStartSettings, staging: Path, progress: object) -> dict[str, object]:
        (staging / "model.safetensors").write_text("complete")
        return {}

    monkeypatch.setattr("services.embedded.warmstart.build.build", build)
    assert read_record(target) is None
    ensure_warm_start(WarmStartSettings(evaluate=False))
    assert (target / "model.safetensors").read_text() == "complete"
    assert json.loads((target / RECORD).read_text())["directory"] == str(target)


def test_a_failed_build_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "warm"
    monkeypatch.setattr(cache, "warm_start_dir", lambda settings: target)

    async def build(settings: WarmStartSettings, staging: Path, progress: object) -> dict[str, object]:
        (staging / "model.safetensors").write_text("partial")
        raise RuntimeError("no pair passed validation")

    monkeypatch.setattr("services.embedded.warmstart.build.build", build)
    with pytest.raises(RuntimeError, match="no pair"):
        ensure_warm_start(WarmStartSettings(evaluate=False))
    assert list(tmp_path.iterdir()) == []


def test_settings_follow_the_embedded_run() -> None:
    from services.embedded.settings import RunSettings

    run = RunSettings(
        run_dir=Path("runs/x"), designer_max_prompt_tokens=1024, designer_max_new_tokens=900, agent_max_turns=4
    )
    settings = WarmStartSettings.from_run(run, pairs=5)
    assert (settings.max_prompt_tokens, settings.max_answer_tokens, settings.agent_max_turns) == (1024, 900, 4)
    assert settings.pairs == 5 and settings.checks == run.checks and settings.temperature == run.temperature
    assert settings.cpu_bf16 is native_bf16()  # the learner section sets none: what the CPU does best
    for told in (False, True):  # the learner section's choice is the SFT's too
        told_run = RunSettings(run_dir=Path("runs/x"), learner={"cpu_bf16": told})
        assert WarmStartSettings.from_run(told_run).cpu_bf16 is told


def test_every_setting_is_documented() -> None:
    assert all(field.description for field in WarmStartSettings.model_fields.values())


def test_staging_left_by_a_dead_builder_is_swept_and_a_live_ones_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os
    import subprocess
    import sys

    target = tmp_path / "warm"
    monkeypatch.setattr(cache, "warm_start_dir", lambda settings: target)
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    left = tmp_path / f".warm.{dead.stdout.strip()}.abc123"
    live = tmp_path / f".warm.{os.getppid()}.def456"  # another builder still at work
    for directory in (left, live):
        directory.mkdir()
        (directory / "model.safetensors").write_text("partial")

    async def build(settings: WarmStartSettings, staging: Path, progress: object) -> dict[str, object]:
        return {}

    monkeypatch.setattr("services.embedded.warmstart.build.build", build)
    ensure_warm_start(WarmStartSettings(evaluate=False))
    assert not left.exists() and live.exists() and read_record(target) is not None


async def test_the_runner_awaits_it_inside_its_own_event_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from services.embedded.warmstart import warm_start

    target = tmp_path / "warm"
    monkeypatch.setattr(cache, "warm_start_dir", lambda settings: target)

    async def build(settings: WarmStartSettings, staging: Path, progress: object) -> dict[str, object]:
        return {"pairs": {"valid": 3}}

    monkeypatch.setattr("services.embedded.warmstart.build.build", build)
    assert await warm_start(WarmStartSettings(evaluate=False)) == target
    assert read_record(target)["pairs"] == {"valid": 3}  # type: ignore[index]
