"""Seeds for plays, derived from the env and its weight version, reproducible across processes.

The reference implementation played every unhinted episode on one instance (the global RNG) and
seeded hinted plays with Python's ``hash()``, which changes per process. Here a seed is a pure
function of ``(env_id, weight_version, index)`` through SHA-256, so every worker, restart and arm
agrees on it, and the hinted and unhinted arms of one version share the same list.

>>> play_seeds("env-1", 3, 2) == play_seeds("env-1", 3, 2)
True
>>> play_seeds("env-1", 3, 2) != play_seeds("env-1", 4, 2)
True
"""

from __future__ import annotations

import hashlib

SEED_BOUND = 2**31
"""Seeds lie in ``[0, 2**31)``: every env's ``random.Random(seed)`` and numpy accept them."""


def play_seeds(env_id: str, weight_version: int, count: int) -> list[int]:
    """Return ``count`` distinct seeds for the plays of ``env_id`` at ``weight_version``.

    Args:
        env_id: The environment's id.
        weight_version: The weight version the plays belong to (fresh seeds per version).
        count: How many seeds (the group size G).

    Raises:
        ValueError: ``count`` is negative or ``env_id`` is empty.
    """
    if count < 0:
        raise ValueError(f"seed count must be >= 0, got {count}")
    if not env_id:
        raise ValueError("env_id must be non-empty to derive seeds from it")
    seeds: list[int] = []
    seen: set[int] = set()
    index = 0
    while len(seeds) < count:
        digest = hashlib.sha256(f"spade-seed\x00{env_id}\x00{weight_version}\x00{index}".encode()).digest()
        seed = int.from_bytes(digest[:8], "big") % SEED_BOUND
        index += 1
        if seed not in seen:  # a collision among G seeds is astronomically rare, but never repeat
            seen.add(seed)
            seeds.append(seed)
    return seeds
