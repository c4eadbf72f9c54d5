"""Static pools: environments the run plays for its whole length, besides or instead of designed ones.

``spade run --designer off --pool FILE_OR_DIR`` is the paper's static-pool baseline: the agent trains
alone, with the same rollout and learner, on a fixed set of environments. The pool is read from

- an ``envs.jsonl`` export (a run's, or ``spade envs export``'s), a run directory (its ``memory.db``
  or ``envs.jsonl``) or a ``memory.db`` file — the envs that passed validation there
  (``services.eval.pool_source``);
- a directory of env files: ``*.py`` env code (hint, if any, in ``<name>.hint``; skill, if any, on a
  first line ``# skill: NAME``), and ``*.md`` / ``*.txt`` designer answers (one ```` ```python ````
  block, ``### HINT``, the hint; the pool designer's format).

Every env is validated in the sandbox before it is stored; an env that fails is left out and named
(with its failing checks) in the run's log and report, never played.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from spade.envs.types import Setting
from spade.memory.records import EnvStatus, NewEnvironment, PutResult
from spade.queues.base import ENVS_READY, WorkQueue
from spade.serving.logs import get_logger
from spade.wire_enums import to_wire

log = get_logger(__name__)

STATIC_SKILL = "static pool"
"""The skill of a static env that names none."""

Validate = Callable[[str, str], Awaitable[Any]]
"""``validate(code, setting) -> ValidationReport``: the sandbox's validation pipeline."""


class StaticPoolError(ValueError):
    """The pool cannot be read or holds nothing playable (the message names the source and the fix)."""


@dataclass(frozen=True)
class StaticEnv:
    """One environment of a static pool, as read.

    Attributes:
        name: Where it came from (file name or env id of the export).
        setting: ``game`` or ``tool``.
        skill: The skill it names, or :data:`STATIC_SKILL`.
        code: Its code.
        hint: Its hint ("" when it has none: the hinted arm is then played with an empty hint).
    """

    name: str
    setting: str
    skill: str
    code: str
    hint: str = ""


@dataclass
class StaticPool:
    """What loading a static pool did.

    Attributes:
        source: Where it was read from.
        stored: Env ids stored and announced.
        rejected: ``(name, failing checks)`` of the envs that failed validation.
    """

    source: str
    stored: list[str] = field(default_factory=list)
    rejected: list[tuple[str, list[str]]] = field(default_factory=list)


class _Memory(Protocol):
    async def put_environment(self, env: NewEnvironment) -> PutResult: ...


def _skill_line(text: str) -> tuple[str | None, str]:
    from services.designer.pool_files import parse_answer_file

    answer = parse_answer_file("x", text)
    return answer.skill, answer.text


def read_static_pool(source: Path, setting: str) -> list[StaticEnv]:
    """The envs of ``source`` for ``setting`` (see the module docstring for the formats).

    Raises:
        StaticPoolError: Missing or unreadable source, a malformed answer file, or no env of ``setting``.
    """
    if not source.exists():
        raise StaticPoolError(
            f"static pool {source} does not exist: pass an envs.jsonl, a run directory or a directory of env files"
        )
    exported = source.is_file() or (source / "memory.db").exists() or (source / "envs.jsonl").exists()
    envs = _read_export(source, setting) if exported else _read_directory(source, setting)
    if not envs:
        raise StaticPoolError(f"static pool {source} holds no {setting} environment: nothing to play")
    return envs


def _read_export(source: Path, setting: str) -> list[StaticEnv]:
    from services.eval.pool_source import PoolSourceError, load_pool, playable
    from services.eval.wiring import read_memory_database

    try:
        found = playable(load_pool(str(source), read_memory_database), setting)
    except PoolSourceError as exc:
        raise StaticPoolError(str(exc)) from None
    return [StaticEnv(e.env_id, e.setting, e.skill or STATIC_SKILL, e.code, e.hint) for e in found]


def _read_directory(directory: Path, setting: str) -> list[StaticEnv]:
    from services.designer.core.parsing import ParseFailure, parse_output

    envs = []
    files = sorted(p for p in directory.iterdir() if p.is_file() and not p.name.startswith("."))
    for path in files:
        if path.name.upper().startswith("README"):
            continue
        if path.suffix == ".py":
            skill, code = _skill_line(path.read_text(encoding="utf-8"))
            hint_file = path.with_suffix(".hint")
            hint = hint_file.read_text(encoding="utf-8").strip() if hint_file.exists() else ""
            envs.append(StaticEnv(path.name, setting, skill or STATIC_SKILL, code, hint))
        elif path.suffix in (".md", ".txt"):
            skill, text = _skill_line(path.read_text(encoding="utf-8"))
            parsed = parse_output(text)
            if isinstance(parsed, ParseFailure):
                raise StaticPoolError(f"static pool file {path} is not a designer answer: {parsed.detail}")
            envs.append(StaticEnv(path.name, setting, skill or STATIC_SKILL, parsed.code, parsed.hint))
    if not envs:
        raise StaticPoolError(
            f"static pool {directory} holds no env file (*.py env code, or *.md/*.txt designer answers)"
        )
    return envs


async def store_static_pool(
    envs: Sequence[StaticEnv],
    *,
    source: str,
    memory: _Memory,
    queue: WorkQueue,
    validate: Validate,
    window_versions: int,
    spec_id: str = "",
    origin: str = "static pool",
) -> StaticPool:
    """Validate each env in the sandbox, store the valid ones and announce them for ``window_versions``.

    ``origin`` (``static pool`` or ``seed pool``) heads each env's ``corpus_ref``, which is how the
    run's export and report tell where an env came from.

    Raises:
        StaticPoolError: No env passed validation.
    """
    from spade.queues.messages import publish_proto
    from spade.v1 import queues_pb2

    result = StaticPool(source=source)
    for env in envs:
        report = await validate(env.code, env.setting)
        if not report.valid:
            failed = [c.name for c in report.checks if not c.passed]
            log.warning("%s: %s failed validation (%s); it is left out", origin, env.name, ", ".join(failed))
            result.rejected.append((env.name, failed))
            continue
        put = await memory.put_environment(
            NewEnvironment(
                setting=Setting.parse(env.setting),
                skill=env.skill,
                code=env.code,
                hint=env.hint,
                validation_report=report.to_dict(),
                status=EnvStatus.VALID,
                weight_version=0,
                env_class=str(getattr(report, "env_class", "")),
                corpus_ref=f"{origin}: {env.name}",
            )
        )
        env_id = put.duplicate_of or put.env_id
        message = queues_pb2.EnvReady(
            env_id=env_id,
            setting=to_wire(Setting.parse(env.setting)),
            skill=env.skill,
            weight_version=0,
            window_versions=window_versions,
            spec_id=spec_id,
        )
        await publish_proto(queue, ENVS_READY, message, key=f"{origin.split(maxsplit=1)[0]}-{env_id}")
        result.stored.append(env_id)
    if not result.stored:
        names = "; ".join(f"{name}: {', '.join(checks)}" for name, checks in result.rejected)
        raise StaticPoolError(f"no env of the {origin} {source} passed validation ({names})")
    return result
