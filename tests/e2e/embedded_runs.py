"""What the ``spade run`` end-to-end tests share: the small settings, the fixtures' answers and readers of
a run directory. Each run lives in its own test module (one module-scoped run each), so that
``make test``'s workers (pytest-xdist, ``--dist loadfile``) run the runs side by side.

Every generation carries a seed derived from the run, env, version, seed, arm and turn (the rollout's
``sampling_seed``), env ids are content addresses of the env's code (so the seeds a play gets are
the same on every run), and so the plays, and with them every assertion of these tests, are the same
on every run up to the float sums of the server's batch shapes. Before env ids were content addresses
they were random, so every run played other seeds and samples: the ``--designer off`` run trained or
not by luck (CI saw both of its groups all 0, once at G = 4 and once at G = 8).
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "designer_pool" / "game"
SMALL = {
    "group_size": 4,
    "agent_max_turns": 3,
    # Long enough for NumberHunt's guess in most replies: its graded returns then differ across seeds,
    # so the policy run's first step has a group with variance to train on (at 12 tokens nearly every
    # return was 0).
    "agent_max_tokens_per_turn": 16,
    "designer_max_prompt_tokens": 1536,
    "temperature": 1.0,
    "held_out_eval": False,  # the policy run scores the held-out families; the others need not
    # The untouched model: the warm start is built once by `spade warmstart` (its own tests), and these
    # runs test the loop, not the warm start (a default run would first spend ~15 min building it).
    "designer_init": "base",
    # fp32 serving, whatever the CPU: the plays then repeat from run to run (see the docstring), where
    # bf16's rounding lets the batch's composition flip sampled tokens.
    "inference": {"weights": "float32"},
}

# Runs that must train: 8 seeds per group, so that a group of NumberHunt's graded returns has spread
# (a group without variance trains nothing). The plays are the same on every run (see the docstring).
G = 8
TRAINING = {**SMALL, "group_size": G}


def lines(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of ``path`` (none when it does not exist)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def weights(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory's safetensors shards."""
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    return tensors


def stored_plays(run_dir: Path) -> list[tuple[str, int, bool, float, int, str]]:
    """(env id, seed, hinted, return, window index, finish reason) of every stored play of a run."""
    with sqlite3.connect(run_dir / "memory.db") as db:
        return db.execute(
            "SELECT env_id, seed, hinted, episode_return, window_index, finish_reason FROM plays"
        ).fetchall()
