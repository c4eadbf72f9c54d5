"""Seeds for plays, derived from the env and its window slot, reproducible across processes.

The reference implementation played every unhinted episode on one instance (the global RNG) and
seeded hinted plays with Python's ``hash()``, which changes per process. Here a seed is a pure
function of ``(env_id, slot, index)`` through SHA-256, so every worker, restart and arm agrees on
it, the hinted and unhinted arms of slot 0 share the same list, and every later slot of the window
gets fresh seeds (whatever version it is played at: a late slot keeps its own seeds). The seed
distribution itself (uniform in ``[0, SEED_BOUND)``) is ``spade.envs.seeds``'s, shared with the
sandbox's validation, which draws its seeds from it in secret.

>>> play_seeds("env-1", 0, 2) == play_seeds("env-1", 0, 2)
True
>>> set(play_seeds("env-1", 0, 2)).isdisjoint(play_seeds("env-1", 1, 2))
True
"""

from __future__ import annotations

import hashlib

from spade.envs.seeds import SEED_BOUND, seed_from_bytes

__all__ = ["SEED_BOUND", "play_seeds"]


def play_seeds(env_id: str, slot: int, count: int) -> list[int]:
    """Return ``count`` distinct seeds for the plays of ``env_id`` in window slot ``slot``.

    Args:
        env_id: The environment's id.
        slot: The window slot the plays belong to (0..k-1; fresh seeds per slot).
        count: How many seeds (the group size G).

    Raises:
        ValueError: ``count`` or ``slot`` is negative, or ``env_id`` is empty.
    """
    if slot < 0:
        raise ValueError(f"slot must be >= 0 (a window slot 0..k-1), got {slot}")
    if count < 0:
        raise ValueError(f"seed count must be >= 0, got {count}")
    if not env_id:
        raise ValueError("env_id must be non-empty to derive seeds from it")
    seeds: list[int] = []
    seen: set[int] = set()
    index = 0
    while len(seeds) < count:
        digest = hashlib.sha256(f"spade-seed\x00{env_id}\x00slot{slot}\x00{index}".encode()).digest()
        seed = seed_from_bytes(digest)
        index += 1
        if seed not in seen:  # a collision among G seeds is astronomically rare, but never repeat
            seen.add(seed)
            seeds.append(seed)
    return seeds
