"""The seed distribution of plays, in one place: the rollout's seeds and validation's secret seeds.

A play's seed is uniform in ``[0, SEED_BOUND)``, made from 8 bytes by ``seed_from_bytes``. The rollout
derives those bytes from SHA-256 of ``(env_id, slot, index)`` (``services/rollout/core/seeds.py``),
so every process agrees on them; a validation draws them from ``os.urandom`` (``secret_seeds``), so
the env it judges cannot know its seeds ahead of time, nor tell them from the seeds of a real play.
Standard library only.

>>> seed_from_bytes(bytes(8)), seed_from_bytes(b"\\xff" * 8) == SEED_BOUND - 1
(0, True)
>>> len(set(secret_seeds(5))) == 5
True
"""

from __future__ import annotations

import os

SEED_BOUND = 2**31
"""Seeds lie in ``[0, 2**31)``: every env's ``random.Random(seed)`` and numpy accept them."""


def seed_from_bytes(data: bytes) -> int:
    """The play seed made from the first 8 bytes of ``data`` (uniform bytes give a uniform seed).

    Raises:
        ValueError: ``data`` is shorter than 8 bytes.
    """
    if len(data) < 8:
        raise ValueError(f"a seed needs 8 bytes of entropy, got {len(data)}")
    return int.from_bytes(data[:8], "big") % SEED_BOUND


def secret_seeds(count: int) -> list[int]:
    """``count`` distinct seeds from the play distribution, drawn from ``os.urandom``.

    Raises:
        ValueError: ``count`` is negative.
    """
    if count < 0:
        raise ValueError(f"seed count must be >= 0, got {count}")
    seeds: list[int] = []
    while len(seeds) < count:
        seed = seed_from_bytes(os.urandom(8))
        if seed not in seeds:
            seeds.append(seed)
    return seeds
