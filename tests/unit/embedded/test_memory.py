"""The embedded run's allocator settings (services.embedded.system): torch's freed blocks are reused, not re-faulted."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

_FAULTS = """
import resource, sys
import torch
from services.embedded.system import keep_freed_memory

if sys.argv[1] == "keep":
    assert keep_freed_memory()

def faults_of_a_block():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = torch.ones(16 * 2**20)  # 64 MiB: glibc would mmap it afresh every time
    del block
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

faults_of_a_block()  # the first one grows the heap
print(min(faults_of_a_block() for _ in range(3)))
"""


def _faults(mode: str) -> int:
    done = subprocess.run(
        [sys.executable, "-c", _FAULTS, mode], check=True, capture_output=True, text=True, timeout=120
    )
    return int(done.stdout.strip().splitlines()[-1])


def _huge_pages_always() -> bool:
    """With transparent huge pages always on, a fresh 64 MiB mapping faults 2 MiB pages: a few dozen faults."""
    with contextlib.suppress(OSError):
        return "[always]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_freed_block_is_reused_without_page_faults() -> None:
    pages = 16 * 2**20 * 4 // 4096  # the block's 4 KiB pages
    if not _huge_pages_always():
        assert _faults("default") >= pages // 2  # glibc's default: a fresh mapping, every page faulted again
    assert _faults("keep") < pages // 20  # kept in the heap: its pages are reused as they are


def test_freed_memory_is_handed_back_only_once_the_process_holds_most_of_its_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from services.embedded import system

    monkeypatch.setattr(system, "_cgroup_limit", lambda: None)
    assert system.release_if_crowded(share=0.0)  # any process holds more than nothing
    assert not system.release_if_crowded(share=1.0)  # and none more than the whole machine
    monkeypatch.setattr(system, "_cgroup_limit", lambda: 4096)  # a container's limit, not the machine's memory
    assert system.release_if_crowded(share=1.0)


_STEP = """
import ctypes, sys
from services.embedded import system

if sys.argv[1] == "keep":
    assert system.keep_freed_memory()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]

def resident_mib():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20

blocks = [libc.malloc(64 * 1024) for _ in range(3200)]  # 200 MiB of heap blocks, under the mmap threshold
for block in blocks:
    ctypes.memset(block, 1, 64 * 1024)
for block in blocks[:-1]:
    libc.free(block)  # the last one stays: the heap's top cannot shrink, so the freed pages stay resident
before = resident_mib()
print(system.release_after_step(), round(before - resident_mib()))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_step_hands_memory_back_every_time_unless_the_run_keeps_it() -> None:
    """The library's run (tests, notebooks) keeps glibc's defaults, whose heap grows by gigabytes a step
    without a trim: it trims every step. `spade run`, which keeps freed memory, waits for a crowded machine."""

    def step(mode: str) -> tuple[str, int]:
        done = subprocess.run(
            [sys.executable, "-c", _STEP, mode], check=True, capture_output=True, text=True, timeout=120
        )
        released, mib = done.stdout.strip().splitlines()[-1].split()
        return released, int(mib)

    released, mib = step("default")
    assert released == "True" and mib > 150  # the 200 MiB freed went back
    released, mib = step("keep")
    assert released == "False" and mib < 10  # kept: the process holds far under 70% of the machine


_RUN_KEEPS = """
import sys
from click.testing import CliRunner
from services.embedded import system
from services.embedded.cli import run

result = CliRunner().invoke(run, ["--config", sys.argv[1]])  # refused before the run starts, after the allocator
assert result.exit_code == 2, result.output
print(system._kept)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
@pytest.mark.parametrize(("switch", "kept"), [(None, "True"), ("0", "False")])
def test_spade_run_keeps_freed_memory_unless_switched_off(tmp_path: Path, switch: str | None, kept: str) -> None:
    config = tmp_path / "run.yaml"
    config.write_text("steps: 0\n")
    env = {k: v for k, v in os.environ.items() if k != "SPADE_KEEP_FREED_MEMORY"}  # the suite sets it to 0
    if switch is not None:
        env["SPADE_KEEP_FREED_MEMORY"] = switch
    command = [sys.executable, "-c", _RUN_KEEPS, str(config)]
    done = subprocess.run(command, check=True, capture_output=True, text=True, timeout=120, env=env)
    assert done.stdout.strip().splitlines()[-1] == kept
