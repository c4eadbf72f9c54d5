"""Reading the run spec from the memory at a service's start (distributed mode), and spec files.

Every service of a distributed run reads the one stored :class:`spade.runspec.RunSpec` when it
starts (WAVE2 §2). :func:`fetch_run_spec` does it the same way everywhere: it returns the stored
spec; when none is stored yet it stores the service's own spec file if it was given one, and
otherwise waits, logging what it waits for, until ``spade runspec set FILE`` (or another service)
stores one. A spec file that differs from the stored spec is refused with each field named.

>>> import tempfile, pathlib
>>> path = pathlib.Path(tempfile.mkdtemp()) / "spec.yaml"
>>> _ = path.write_text("group_size: 8\\n")
>>> load_spec_file(path).group_size
8
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Protocol

from pydantic import ValidationError

from spade.config import ConfigError, read_config_file
from spade.memory.errors import MemoryUnavailable, RunSpecConflict, RunSpecNotSet
from spade.memory.records import RunSpecRecord
from spade.runspec import RunSpec
from spade.serving.logs import get_logger

log = get_logger(__name__)


class RunSpecStore(Protocol):
    """The memory's run spec calls (``MemoryService`` in process, ``MemoryClient`` over gRPC)."""

    async def get_run_spec(self) -> RunSpecRecord: ...

    async def set_run_spec(self, spec: RunSpec, replace: bool = False) -> RunSpecRecord: ...


def spec_differences(stored: RunSpec, given: RunSpec) -> list[str]:
    """One ``field: stored X, given Y`` per field that differs (reward constants as ``rewards.<field>``)."""

    def flat(spec: RunSpec) -> dict[str, object]:
        out: dict[str, object] = {}
        for name, value in spec.model_dump(mode="json").items():
            if isinstance(value, dict):
                out.update({f"{name}.{k}": v for k, v in value.items()})
            else:
                out[name] = value
        return out

    a, b = flat(stored), flat(given)
    return [f"{k}: stored {a[k]!r}, given {b.get(k)!r}" for k in sorted(a) if a[k] != b.get(k)]


def conflict_message(stored: RunSpec, given: RunSpec) -> str:
    """Why ``given`` cannot be used while ``stored`` is the run's spec, and what to do."""
    return (
        f"the memory holds run spec {stored.spec_id}, which differs from {given.spec_id} in "
        f"{'; '.join(spec_differences(stored, given))}; every service of a run must agree on one spec: "
        "use the stored one, or replace it deliberately (`spade runspec set FILE --replace`, then restart "
        "every service)"
    )


def load_spec_file(path: Path) -> RunSpec:
    """A run spec from a YAML or JSON file of ``RunSpec`` fields (missing fields take the defaults).

    Raises:
        ConfigError: The file is unreadable, not a mapping, or breaks a rule of the spec (one line
            per problem, naming the field).
    """
    data = read_config_file(Path(path))
    try:
        return RunSpec.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'spec'}: {e['msg']}" for e in exc.errors())
        raise ConfigError(f"{path}: not a valid run spec: {problems}") from None


async def fetch_run_spec(
    memory: RunSpecStore,
    *,
    given: RunSpec | None = None,
    service: str = "service",
    poll_s: float = 2.0,
    log_every_s: float = 30.0,
    timeout_s: float | None = None,
) -> RunSpec:
    """The run's spec as the memory holds it, waiting (with a log line) until one is stored.

    Args:
        memory: The memory (client or in-process service).
        given: The spec this service was started with (a spec file), stored when none is.
        service: Names the service in the log lines.
        poll_s: Seconds between two looks while waiting.
        log_every_s: Seconds between two "still waiting" lines.
        timeout_s: Give up after this long (``None``: wait until one is stored).

    Raises:
        RunSpecConflict: ``given`` differs from the stored spec (each field named).
        TimeoutError: ``timeout_s`` passed without a spec being stored.
    """
    start = time.monotonic()
    last_log = -float("inf")
    while True:
        try:
            record = await memory.get_run_spec()
        except MemoryUnavailable as exc:  # starting, restarting, its name not resolvable yet: keep waiting
            now = time.monotonic()
            if timeout_s is not None and now - start >= timeout_s:
                raise TimeoutError(f"{service}: the memory was not reachable within {timeout_s:.0f} s: {exc}") from None
            if now - last_log >= log_every_s:
                log.warning("%s: waiting for the memory to read the run spec: %s", service, exc)
                last_log = now
            await asyncio.sleep(poll_s)
            continue
        except RunSpecNotSet:
            if given is not None:
                record = await memory.set_run_spec(given)  # a concurrent writer's different spec raises
            else:
                now = time.monotonic()
                if timeout_s is not None and now - start >= timeout_s:
                    raise TimeoutError(
                        f"{service}: no run spec was stored in the memory within {timeout_s:.0f} s; "
                        "store one with `spade runspec set FILE`"
                    ) from None
                if now - last_log >= log_every_s:
                    log.warning(
                        "%s: waiting for a run spec in the memory (store one with `spade runspec set FILE`)",
                        service,
                    )
                    last_log = now
                await asyncio.sleep(poll_s)
                continue
        stored = RunSpec.from_json(record.spec_json)
        if given is not None and stored.spec_id != given.spec_id:
            raise RunSpecConflict(conflict_message(stored, given))
        log.info("%s: run spec %s", service, stored.spec_id, extra={"spec_id": stored.spec_id})
        return stored


__all__ = ["ConfigError", "RunSpecStore", "conflict_message", "fetch_run_spec", "load_spec_file", "spec_differences"]
