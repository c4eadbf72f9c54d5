"""One cgroup holding every jail of a sandbox pool, so that limits hold across sessions in total.

Per jail, the sandbox has rlimits (per process: address space, CPU time, open files, file size; per
jail: processes, through its own user namespace) and its own tmpfs. Those do not add up to a
bound on the whole pool: 32 jails of 512 MiB processes could ask for 16 GiB. So at start the pool
puts its zygotes (and with them every jail they fork) into a cgroup of its own, with a memory
limit, a process limit and a CPU weight for all of them together:

- **cgroup v2** (one unified hierarchy at ``/sys/fs/cgroup``): a child of the service's own cgroup,
  with ``memory.max``, ``memory.swap.max`` = 0, ``pids.max`` and ``cpu.weight``. This needs the
  controllers enabled in the service's cgroup, which the kernel allows only if no process sits in it
  (a delegated or empty cgroup, or the root).
- **cgroup v1** (one hierarchy per controller): a child of the service's cgroup in the ``memory``,
  ``pids`` and ``cpu`` hierarchies, with ``memory.limit_in_bytes`` (and ``memory.memsw`` when swap is
  accounted), ``pids.max`` and ``cpu.shares``.
- **neither** (no write access: a container without delegation, a rootless service): the jails stay
  in the service's own cgroup; whatever limits that cgroup has (a pod's or container's) then hold
  for the pool and the service together. ``probe`` says which.

``CgroupPlan.detail`` is what the pool logs at start and shows in ``health()``. Linux only.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
V1_CONTROLLERS = ("memory", "pids", "cpu")
V2_CONTROLLERS = ("memory", "pids", "cpu")


class CgroupUnavailable(RuntimeError):
    """A cgroup was required (``cgroup: required``) and none could be made; the message says why."""


@dataclass(frozen=True)
class CgroupLimits:
    """What the pool's cgroup holds its jails to, in total."""

    memory_bytes: int
    processes: int
    cpu_weight: int

    def to_dict(self) -> dict[str, int]:
        return {"memory_bytes": self.memory_bytes, "processes": self.processes, "cpu_weight": self.cpu_weight}


@dataclass(frozen=True)
class CgroupPlan:
    """The pool's cgroup, once made.

    Attributes:
        version: ``"v2"``, ``"v1"`` or ``None`` (no cgroup of the pool's own).
        dirs: the cgroup directories made (one per hierarchy), removed at stop.
        detail: what holds, in words (logged at start, shown in ``health()``).
        limits: the limits written, when a cgroup was made.
    """

    version: str | None
    dirs: tuple[Path, ...] = ()
    detail: str = ""
    limits: CgroupLimits | None = None
    procs: tuple[Path, ...] = field(default=())

    def launcher(self) -> list[str]:
        """An argv prefix that moves the process into the cgroup, then execs the rest of the argv."""
        if not self.procs:
            return []
        moves = " && ".join(f"echo $$ > {shlex.quote(str(p))}" for p in self.procs)
        return ["/bin/sh", "-c", f'{moves} && exec "$@"', "spade-sandbox-cgroup"]

    def to_dict(self) -> dict[str, object]:
        return {
            "version": self.version,
            "paths": [str(d) for d in self.dirs],
            "limits": self.limits.to_dict() if self.limits else None,
            "detail": self.detail,
        }


def own_cgroups(proc_self_cgroup: str) -> dict[str, str]:
    """This process's cgroup path per hierarchy: ``""`` for v2's unified one, else each v1 controller.

    >>> own_cgroups("0::/user.slice\\n4:memory:/box\\n2:cpu,cpuacct:/\\n")
    {'': '/user.slice', 'memory': '/box', 'cpu': '/', 'cpuacct': '/'}
    """
    paths: dict[str, str] = {}
    for line in proc_self_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        for controller in controllers.split(",") if controllers else [""]:
            paths[controller] = path
    return paths


def _write(path: Path, value: str) -> None:
    path.write_text(value)


def _read_limit(path: Path) -> str | None:
    with contextlib.suppress(OSError):
        value = path.read_text().strip()
        return None if value in ("max", "9223372036854771712", "") else value
    return None


def _enclosing(root: Path, own: dict[str, str], why: str) -> CgroupPlan:
    """No cgroup of our own: say what the service's own cgroup holds everything to."""
    held = []
    if "" in own and (root / "cgroup.controllers").exists():
        base = root / own[""].lstrip("/")
        for name, file in (("memory", "memory.max"), ("processes", "pids.max")):
            value = _read_limit(base / file)
            if value:
                held.append(f"{name} {value}")
    else:
        for controller, file, name in (
            ("memory", "memory.limit_in_bytes", "memory"),
            ("pids", "pids.max", "processes"),
        ):
            if controller in own:
                value = _read_limit(root / controller / own[controller].lstrip("/") / file)
                if value:
                    held.append(f"{name} {value}")
    limits = (
        f"the service's own cgroup limits {', '.join(held)} for the service and its jails together"
        if held
        else ("the service's own cgroup sets no memory or process limit")
    )
    return CgroupPlan(
        None,
        detail=f"no cgroup of the pool's own ({why}): per-jail rlimits hold, and {limits}",
    )


def _make_v2(root: Path, own: dict[str, str], name: str, limits: CgroupLimits) -> CgroupPlan:
    parent = root / own[""].lstrip("/")
    enabled = (parent / "cgroup.subtree_control").read_text().split()
    missing = [c for c in V2_CONTROLLERS if c not in enabled]
    if missing:
        _write(parent / "cgroup.subtree_control", " ".join(f"+{c}" for c in missing))
    path = parent / name
    path.mkdir()
    try:
        _write(path / "memory.max", str(limits.memory_bytes))
        with contextlib.suppress(FileNotFoundError):  # no swap accounting: nothing to forbid
            _write(path / "memory.swap.max", "0")
        _write(path / "pids.max", str(limits.processes))
        _write(path / "cpu.weight", str(limits.cpu_weight))
    except BaseException:
        path.rmdir()
        raise
    return CgroupPlan(
        "v2",
        (path,),
        f"cgroup v2 {path}: all jails together hold at most {limits.memory_bytes >> 20} MiB and "
        f"{limits.processes} processes, cpu.weight {limits.cpu_weight}; per jail, rlimits",
        limits,
        (path / "cgroup.procs",),
    )


def _make_v1(root: Path, own: dict[str, str], name: str, limits: CgroupLimits) -> CgroupPlan:
    made: list[Path] = []
    try:
        for controller in V1_CONTROLLERS:
            path = root / controller / own[controller].lstrip("/") / name
            path.mkdir()
            made.append(path)
        memory, pids, cpu = made
        _write(memory / "memory.limit_in_bytes", str(limits.memory_bytes))
        if (memory / "memory.memsw.limit_in_bytes").exists():
            _write(memory / "memory.memsw.limit_in_bytes", str(limits.memory_bytes))
        _write(pids / "pids.max", str(limits.processes))
        _write(cpu / "cpu.shares", str(max(2, limits.cpu_weight * 1024 // 100)))
    except BaseException:
        for path in reversed(made):
            with contextlib.suppress(OSError):
                path.rmdir()
        raise
    return CgroupPlan(
        "v1",
        tuple(made),
        f"cgroup v1 {made[0].relative_to(root / 'memory')} (memory, pids, cpu): all jails together hold at most "
        f"{limits.memory_bytes >> 20} MiB and {limits.processes} processes, cpu.shares "
        f"{max(2, limits.cpu_weight * 1024 // 100)}; per jail, rlimits",
        limits,
        tuple(p / "cgroup.procs" for p in made),
    )


def make_cgroup(name: str, limits: CgroupLimits, *, root: Path = CGROUP_ROOT, required: bool = False) -> CgroupPlan:
    """Make the pool's cgroup ``name`` under the service's own (see the module docstring).

    Raises:
        CgroupUnavailable: ``required`` and no cgroup could be made.
    """
    try:
        own = own_cgroups(Path("/proc/self/cgroup").read_text())
    except OSError as exc:
        own, why = {}, f"/proc/self/cgroup unreadable: {exc.strerror}"
    else:
        why = ""
    errors = []
    if (root / "cgroup.controllers").exists() and "" in own:
        try:
            return _make_v2(root, own, name, limits)
        except OSError as exc:
            errors.append(f"cgroup v2 at {root}: {exc.strerror or exc}")
    elif all((root / c / "cgroup.procs").exists() and c in own for c in V1_CONTROLLERS):
        try:
            return _make_v1(root, own, name, limits)
        except OSError as exc:
            errors.append(f"cgroup v1 at {root}: {exc.strerror or exc}")
    else:
        errors.append(why or f"no cgroup v2 or v1 memory/pids/cpu hierarchies at {root}")
    reason = "; ".join(errors)
    if required:
        raise CgroupUnavailable(
            f"sandbox refuses to start: no cgroup for its jails ({reason}); run the service as root with "
            "cgroups writable (or delegated), or set SPADE_SANDBOX_ISOLATION__CGROUP=auto to go on with "
            "per-jail rlimits only"
        )
    return _enclosing(root, own, reason)


def remove_cgroup(plan: CgroupPlan, timeout_s: float = 3.0) -> None:
    """Remove the pool's cgroup once its processes are gone (they may take a moment to exit)."""
    deadline = time.monotonic() + timeout_s
    for path in plan.dirs:
        while True:
            try:
                os.rmdir(path)
                break
            except FileNotFoundError:
                break
            except OSError:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.02)
