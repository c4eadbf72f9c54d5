"""The seed pool: the contract library's example environments, stored and announced at version 0.

A small policy cannot yet write valid environments; the seed pool gives the agent something to play
from the first step and the designer examples to learn from. Embedded mode (``spade run``) and
operators in distributed mode (``spade envs seed``) load it the same way.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from spade.envs.types import Setting
from spade.memory.records import EnvStatus, NewEnvironment, PutResult
from spade.queues.base import ENVS_READY, WorkQueue
from spade.queues.messages import publish_proto
from spade.v1 import queues_pb2
from spade.wire_enums import to_wire

Validate = Callable[[str, str], Awaitable[Any]]
"""``validate(code, setting) -> ValidationReport`` (the sandbox), used to check each example first."""


class _Memory(Protocol):
    async def put_environment(self, env: NewEnvironment) -> PutResult: ...


class SeedPoolError(RuntimeError):
    """An example env failed validation: the seed pool must only hold valid environments."""


async def seed_pool(
    setting: str,
    memory: _Memory,
    queue: WorkQueue,
    *,
    window_versions: int = 0,
    validate: Validate | None = None,
    names: Sequence[str] | None = None,
    new: list[str] | None = None,
) -> list[str]:
    """Store every example env of ``setting`` and announce it on ``envs.ready``; returns the env ids.

    Idempotent: the memory stores identical code once and the announcement's queue key is the env id,
    so seeding twice changes nothing.

    Args:
        setting: ``"game"`` or ``"tool"``.
        memory: ``MemoryService`` or the gRPC ``MemoryClient``.
        queue: The work queue the rollout consumes.
        window_versions: Weight versions the seed envs stay active (0: the rollout's own k).
        validate: When given, each example is validated first and its report stored with it.
        names: Only these examples (default: every example of ``setting``).
        new: When given, receives the ids this call stored (the others were stored already, and
            announcing them again changes nothing).

    Raises:
        SeedPoolError: An example failed validation (names the env and its failing checks).
    """
    from spade.envs.examples import EXAMPLES

    unknown = sorted(set(names or ()) - set(EXAMPLES))
    if unknown:
        raise SeedPoolError(f"no example env named {unknown}; known: {sorted(EXAMPLES)}")
    stored: list[str] = []
    for name, example in sorted(EXAMPLES.items()):
        if example.setting.value != setting or (names and name not in names):
            continue
        report: dict[str, Any] = {"valid": True, "setting": setting, "checks": [], "source": "seed pool"}
        env_class = ""
        if validate is not None:
            checked = await validate(example.code, setting)
            if not checked.valid:
                failed = [c.name for c in checked.checks if not c.passed]
                raise SeedPoolError(f"example env {name} failed validation ({failed}): fix it before seeding")
            report = checked.to_dict() if hasattr(checked, "to_dict") else report
            env_class = str(getattr(checked, "env_class", ""))
        put = await memory.put_environment(
            NewEnvironment(
                setting=Setting.parse(setting),
                skill=example.skill,
                code=example.code,
                hint=example.hint,
                validation_report=report,
                status=EnvStatus.VALID,
                weight_version=0,
                env_class=env_class,
                corpus_ref=f"seed pool: {name}",
            )
        )
        env_id = put.duplicate_of or put.env_id
        if new is not None and not put.duplicate_of:
            new.append(env_id)
        message = queues_pb2.EnvReady(
            env_id=env_id,
            setting=to_wire(Setting.parse(setting)),
            skill=example.skill,
            weight_version=0,
            window_versions=window_versions,
        )
        await publish_proto(queue, ENVS_READY, message, key=f"seed-{env_id}")
        stored.append(env_id)
    return stored
