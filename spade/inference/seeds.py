"""Sampling seeds for reproducible generation: one seed per (run, env, version, seed, arm, turn).

Every generation request of a run can carry SGLang's ``sampling_seed``; with the same seed, prompt
and weights, the server samples the same tokens whatever else is in its batch. Deriving the seed from
where the generation sits in the run (rather than from a global counter) makes a rerun reproduce
each play, and the two regret arms of one env seed stay independent of each other and of the
order in which plays happen to be scheduled.

The derivation is a keyed hash (BLAKE2b) of a canonical encoding of the fields, so seeds of
different coordinates are unrelated and any field change gives a different seed.
"""

from __future__ import annotations

import hashlib
import json

#: Seeds lie in ``[0, SEED_LIMIT)``: non-negative and within SGLang's int64 bound for ``sampling_seed``.
SEED_LIMIT = 2**63


def derive_sampling_seed(run: str, env: str, version: int | str, seed: int, arm: str, turn: int) -> int:
    """The ``sampling_seed`` of one generation.

    Args:
        run: the run's identity (its id or run-spec id).
        env: the environment id.
        version: the weight version the play belongs to (the env's window version).
        seed: the env seed the play uses (``reset(seed)``).
        arm: which arm of the play (e.g. ``"hint"`` / ``"no_hint"``), or a role name.
        turn: the model turn within the play, from 0.

    Returns:
        An integer in ``[0, 2**63)``; equal inputs give equal seeds, in any process.

    >>> a = derive_sampling_seed("run-1", "env-7", 3, 42, "hint", 0)
    >>> a == derive_sampling_seed("run-1", "env-7", 3, 42, "hint", 0)
    True
    >>> a != derive_sampling_seed("run-1", "env-7", 3, 42, "no_hint", 0)
    True
    """
    if turn < 0:
        raise ValueError(f"turn must be >= 0 (the model turn within a play, from 0), got {turn}")
    canonical = json.dumps([run, env, str(version), int(seed), arm, int(turn)], separators=(",", ":"))
    digest = hashlib.blake2b(canonical.encode("utf-8"), digest_size=8, person=b"spade-sampling").digest()
    return int.from_bytes(digest, "big") % SEED_LIMIT
