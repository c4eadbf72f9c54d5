"""Environments of a run's pool, read from its memory database or from a JSONL export.

Sources, by what ``--pool`` names:

- a SQLAlchemy URL (``sqlite:///run/memory.db``, ``postgresql+psycopg://...``): the memory's store,
  read-only; the seeds each env was already played on are read too, so held-out seeds avoid them;
- a ``.db`` file: the same, as ``sqlite:///FILE``;
- a ``.jsonl`` file: one env per line, as a run's ``envs.jsonl`` or ``spade envs export`` writes
  (``env_id`` or ``id``, ``setting``, ``skill``, ``status``, ``code``, ``hint``);
- a run directory: its ``memory.db`` when present, else its ``envs.jsonl``.

Only envs that passed validation (status ``valid`` or ``retired``) are evaluated.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PLAYABLE = ("valid", "retired")
"""Statuses of envs that passed every validation check."""

SEED_BOUND = 2**31
"""Held-out seeds lie in ``[0, 2**31)``, like the rollout's play seeds."""


class PoolSourceError(ValueError):
    """The pool source cannot be read (the message names the source and the fix)."""


@dataclass(frozen=True)
class PoolEnv:
    """One environment of the pool.

    Attributes:
        env_id: The memory's id.
        setting: ``game`` or ``tool``.
        skill: The skill it was designed for (its eval category).
        code: The environment code.
        hint: Its privileged hint (unused by eval: held-out plays are unhinted).
        status: ``valid`` or ``retired``.
        corpus_ref: The corpus document it was grounded in.
        played_seeds: Seeds it was already played on (empty for a JSONL source).
    """

    env_id: str
    setting: str
    skill: str
    code: str
    hint: str = ""
    status: str = "valid"
    corpus_ref: str = ""
    played_seeds: frozenset[int] = field(default_factory=frozenset)

    @property
    def code_hash(self) -> str:
        """SHA-256 of the code (identifies the env across exports)."""
        return hashlib.sha256(self.code.encode("utf-8")).hexdigest()


def held_out_seeds(env_id: str, eval_seed: int, count: int, exclude: frozenset[int] = frozenset()) -> list[int]:
    """``count`` seeds for ``env_id`` that training did not use.

    Training seeds come from ``services.rollout.core.seeds.play_seeds`` (a hash of the env, the
    weight version and an index); these come from a hash with an eval-only tag and the eval's
    seed, so they coincide with a training seed only by chance (about plays / 2**31), and any seed
    in ``exclude`` (the env's recorded plays) is skipped.

    >>> held_out_seeds("env-1", 0, 3) == held_out_seeds("env-1", 0, 3)
    True
    >>> held_out_seeds("env-1", 0, 3) != held_out_seeds("env-1", 1, 3)
    True
    """
    seeds: list[int] = []
    index = 0
    while len(seeds) < count:
        digest = hashlib.sha256(f"spade-eval-held-out\x00{env_id}\x00{eval_seed}\x00{index}".encode()).digest()
        seed = int.from_bytes(digest[:8], "big") % SEED_BOUND
        index += 1
        if seed not in exclude and seed not in seeds:
            seeds.append(seed)
    return seeds


def _from_row(row: dict[str, Any], where: str) -> PoolEnv:
    try:
        env_id = str(row.get("env_id") or row["id"])
        return PoolEnv(
            env_id=env_id,
            setting=str(row["setting"]),
            skill=str(row.get("skill") or "unknown"),
            code=str(row["code"]),
            hint=str(row.get("hint") or ""),
            status=str(row.get("status") or "valid"),
            corpus_ref=str(row.get("corpus_ref") or ""),
        )
    except KeyError as exc:
        raise PoolSourceError(
            f"{where}: an env needs 'env_id' (or 'id'), 'setting' and 'code'; {exc} is missing "
            "(export the pool with `spade envs export` or use a run's envs.jsonl)"
        ) from None


def read_jsonl(path: Path) -> list[PoolEnv]:
    """Envs of a JSONL export, in file order."""
    envs = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise PoolSourceError(f"cannot read the pool file {path}: {exc.strerror or exc}") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PoolSourceError(f"{path}:{number} is not JSON ({exc.msg}); pass a JSON Lines export") from None
        if not isinstance(row, dict):
            raise PoolSourceError(f"{path}:{number} is not a JSON object; each line must be one env")
        envs.append(_from_row(row, f"{path}:{number}"))
    return envs


DatabaseReader = Callable[[str], list[PoolEnv]]
"""Reads the envs of a memory database at a SQLAlchemy URL (oldest first, with their played seeds).

The memory's store is another service's: a composition root hands the reader in
(``services.eval.wiring.read_memory_database``).

Raises:
    PoolSourceError: The database is missing or unreadable.
"""


def load_pool(source: str, read_database: DatabaseReader) -> list[PoolEnv]:
    """Every env of ``source`` (see the module docstring), playable or not; a database through ``read_database``.

    Raises:
        PoolSourceError: The source is missing or unreadable.
    """
    if "://" in source:
        return read_database(source)
    path = Path(source).expanduser()
    if path.is_dir():
        if (path / "memory.db").is_file():
            return read_database(f"sqlite:///{(path / 'memory.db').resolve()}")
        if (path / "envs.jsonl").is_file():
            return read_jsonl(path / "envs.jsonl")
        raise PoolSourceError(f"{path} holds neither memory.db nor envs.jsonl; pass a run directory or a file")
    if not path.is_file():
        raise PoolSourceError(f"no pool at {path}; pass a run directory, its memory.db, a JSONL export or a URL")
    if path.suffix in (".jsonl", ".json", ".ndjson"):
        return read_jsonl(path)
    return read_database(f"sqlite:///{path.resolve()}")


def playable(envs: list[PoolEnv], setting: str | None = None) -> list[PoolEnv]:
    """The envs that passed validation (of ``setting``, when given)."""
    return [e for e in envs if e.status in PLAYABLE and (setting is None or e.setting == setting)]
