"""The pool's cgroup really holds all its jails together: processes and memory summed over jails.

Each jail alone stays within its own rlimits (32 processes, 256 MiB per process); two at once would
not fit in the pool's totals set here, and the kernel refuses what is over. Skipped where the
machine lets the service make no cgroup (the pool then says so in ``health()["cgroup"]``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from services.sandbox.isolation import ExecStatus, IsolationSettings, SandboxPool

pytestmark = pytest.mark.asyncio(loop_scope="session")

HOG = "import time\nhog = bytearray({mb} << 20)\nhog[::4096] = b'x' * len(hog[::4096])\ntime.sleep(2)\nprint('kept')\n"
# Fork until refused, then hold every process for {hold} s, so that a second jail started meanwhile
# competes with them for the pool's processes.
FORKS = (
    "import os, time\nmade = 0\nfor _ in range(40):\n    try:\n        if os.fork() == 0:\n"
    "            time.sleep({hold} + 1)\n            os._exit(0)\n        made += 1\n"
    "    except OSError:\n        break\n"
    "time.sleep({hold})\nprint(made)\n"
)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def pool() -> AsyncIterator[SandboxPool]:
    pool = SandboxPool(
        IsolationSettings(
            memory_mb=256, max_memory_mb=256, total_memory_mb=320, processes=32, total_processes=48, spares=1
        )
    )
    await pool.start()
    try:
        if pool.cgroup.version is None:
            pytest.skip(f"no cgroup on this machine: {pool.cgroup.detail}")
        yield pool
    finally:
        await pool.stop()


def controller_file(pool: SandboxPool, name: str) -> str:
    for path in pool.cgroup.dirs:
        if (path / name).exists():
            return (path / name).read_text()
    raise AssertionError(f"no {name} in {pool.cgroup.dirs}")


async def test_the_zygotes_and_every_jail_are_in_the_pools_cgroup(pool: SandboxPool) -> None:
    zygote = pool.health()["zygotes"][0]["pid"]
    assert any(path.name in Path(f"/proc/{zygote}/cgroup").read_text() for path in pool.cgroup.dirs)
    assert str(zygote) in controller_file(pool, "cgroup.procs").split()


async def test_processes_are_limited_across_jails(pool: SandboxPool) -> None:
    # The first jail forks what it can and holds it; the second starts only once the pool's cgroup
    # counts the first one's processes, so the two overlap however slow the machine is.
    first = asyncio.create_task(pool.execute(FORKS.format(hold=8), timeout_s=40))
    for _ in range(400):
        if int(controller_file(pool, "pids.current")) >= 20:
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError(f"the first jail's processes never showed in the pool's cgroup: {await first}")
    second = await pool.execute(FORKS.format(hold=0), timeout_s=40)
    results = [await first, second]
    assert [r.status for r in results] == [ExecStatus.OK, ExecStatus.OK], results
    made = [int(r.stdout) for r in results]
    assert all(m <= 31 for m in made), made  # each jail: under its own 32
    assert sum(made) < 48 - 2, made  # together: under the pool's 48 (zygote and spares count too)


async def test_memory_is_limited_across_jails(pool: SandboxPool) -> None:
    alone = await pool.execute(HOG.format(mb=200), timeout_s=20)
    assert alone.status is ExecStatus.OK and alone.stdout == b"kept\n", alone
    together = await asyncio.gather(*(pool.execute(HOG.format(mb=200), timeout_s=20) for _ in range(2)))
    # 2 x 200 MiB does not fit in 320 MiB: the kernel stops one of them (out of memory in the cgroup).
    assert [r.status for r in together].count(ExecStatus.OK) <= 1, together
    events = controller_file(pool, "memory.oom_control" if pool.cgroup.version == "v1" else "memory.events")
    kills = dict(line.split() for line in events.splitlines())["oom_kill"]
    assert int(kills) >= 1, events  # the kernel's OOM killer acted inside the pool's cgroup
    # The one it stopped is reported as killed (SIGKILL from the kernel), never as ok or a sandbox fault.
    assert {r.status for r in together} <= {ExecStatus.OK, ExecStatus.KILLED, ExecStatus.MEMORY_LIMIT}
