from __future__ import annotations

import subprocess
import sys

import pytest

from services.rollout.core.seeds import SEED_BOUND, play_seeds


def test_seeds_are_distinct_in_range_and_depend_on_env_and_slot() -> None:
    seeds = play_seeds("env-a", 1, 64)
    assert len(seeds) == 64 == len(set(seeds))
    assert all(0 <= s < SEED_BOUND for s in seeds)
    assert set(seeds).isdisjoint(play_seeds("env-a", 2, 64))  # fresh seeds at each window slot
    assert set(seeds).isdisjoint(play_seeds("env-b", 1, 64))
    assert play_seeds("env-a", 1, 8) == seeds[:8]  # a larger group extends, never reshuffles


def test_seeds_are_identical_in_another_process_whatever_its_hash_seed() -> None:
    # The reference used hash(), which PYTHONHASHSEED changes per process.
    code = "from services.rollout.core.seeds import play_seeds; print(play_seeds('env-a', 3, 5))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env={"PYTHONHASHSEED": "12345"}
    )
    assert out.stdout.strip() == str(play_seeds("env-a", 3, 5))


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="count"):
        play_seeds("e", 0, -1)
    with pytest.raises(ValueError, match="slot"):
        play_seeds("e", -1, 1)
    with pytest.raises(ValueError, match="env_id"):
        play_seeds("", 0, 1)
