"""The pool's cgroup: what is written where, for v2 and v1, and what is said when none can be made.

A directory stands in for the cgroup filesystem (the kernel's own files are plain files there); the
real kernel is exercised by tests/security/test_cgroup.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from services.sandbox.isolation import cgroups
from services.sandbox.isolation.cgroups import CgroupLimits, CgroupUnavailable, make_cgroup

LIMITS = CgroupLimits(memory_bytes=512 << 20, processes=300, cpu_weight=50)


@pytest.fixture
def own(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    paths = {"": "/service"}
    monkeypatch.setattr(cgroups, "own_cgroups", lambda _: dict(paths))
    return paths


def test_v2_enables_the_controllers_and_writes_the_limits(tmp_path: Path, own: dict[str, str]) -> None:
    (tmp_path / "cgroup.controllers").write_text("cpu memory pids io")
    (tmp_path / "service").mkdir()
    (tmp_path / "service" / "cgroup.subtree_control").write_text("pids")
    plan = make_cgroup("pool", LIMITS, root=tmp_path)
    made = tmp_path / "service" / "pool"
    assert plan.version == "v2" and plan.dirs == (made,)
    assert (tmp_path / "service" / "cgroup.subtree_control").read_text() == "+memory +cpu"
    assert {f: (made / f).read_text() for f in ("memory.max", "memory.swap.max", "pids.max", "cpu.weight")} == {
        "memory.max": str(512 << 20),
        "memory.swap.max": "0",
        "pids.max": "300",
        "cpu.weight": "50",
    }
    assert plan.launcher()[:2] == ["/bin/sh", "-c"] and str(made / "cgroup.procs") in plan.launcher()[2]
    assert "512 MiB and 300 processes" in plan.detail


def test_v1_makes_one_cgroup_per_hierarchy(tmp_path: Path, own: dict[str, str]) -> None:
    own.clear()
    own.update({"memory": "/box", "pids": "/", "cpu": "/"})
    for controller, path in own.items():
        (tmp_path / controller / path.lstrip("/")).mkdir(parents=True, exist_ok=True)
        (tmp_path / controller / "cgroup.procs").write_text("")
    plan = make_cgroup("pool", LIMITS, root=tmp_path)
    memory, pids, cpu = plan.dirs
    assert plan.version == "v1" and memory == tmp_path / "memory" / "box" / "pool"
    assert (memory / "memory.limit_in_bytes").read_text() == str(512 << 20)
    assert (pids / "pids.max").read_text() == "300" and (cpu / "cpu.shares").read_text() == "512"
    assert plan.procs == tuple(d / "cgroup.procs" for d in plan.dirs)
    with pytest.raises(CgroupUnavailable):  # a name already taken is never reused
        make_cgroup("pool", LIMITS, root=tmp_path, required=True)


def test_without_a_cgroup_it_says_what_the_services_own_cgroup_holds(tmp_path: Path, own: dict[str, str]) -> None:
    (tmp_path / "cgroup.controllers").write_text("memory pids")
    service = tmp_path / "service"
    service.mkdir()
    (service / "cgroup.subtree_control").write_text("memory pids cpu")
    (service / "memory.max").write_text("1073741824")
    (service / "pids.max").write_text("max")
    (service / "pool").write_text("taken")  # mkdir fails, as it would without write access
    plan = make_cgroup("pool", LIMITS, root=tmp_path)
    assert plan.version is None and plan.launcher() == []
    assert "limits memory 1073741824 for the service and its jails together" in plan.detail
    with pytest.raises(CgroupUnavailable, match="refuses to start: no cgroup"):
        make_cgroup("pool", LIMITS, root=tmp_path, required=True)


def test_no_cgroup_filesystem_at_all(tmp_path: Path, own: dict[str, str]) -> None:
    plan = make_cgroup("pool", LIMITS, root=tmp_path / "missing")
    assert plan.version is None and "per-jail rlimits hold" in plan.detail
