"""GNU OpenMP's thread pools: an idle thread gives its workers back, so the busy thread's workers spin.

torch's CPU kernels run their parallel regions on GNU OpenMP (libgomp). Each thread that starts a
parallel region gets its own pool of worker threads, kept for the thread's whole life. Between
regions a worker spins for a while before it sleeps, but libgomp shortens that spin to about 100
iterations whenever the process holds more OpenMP threads, summed over all pools, than it has CPUs
("throttled" spinning). Then every region wakes its workers from a futex sleep.

A decode step runs about a thousand small regions. On a 2-core machine, one more pool (the thread that
loaded the model, an idle learner's executor thread) is enough to throttle the busy one. The engine's
one-row decode step then took 62 ms instead of 41 ms (Intel Xeon with AVX-512, 2 threads, the default
model after a 600-token prompt). A thread whose torch work is done and which will idle therefore calls
:func:`release_threads`. That is OpenMP 5's ``omp_pause_resource_all(omp_pause_soft)``, which in
libgomp frees the calling thread's pool; its next parallel region starts a new one (tens of
microseconds).

Threads that really compute at the same time still throttle each other, as they should: spinning on
a core another team needs would cost more than the sleep. Dividing the cores between such teams
(the engine and the learner at one thread each while both compute, set per decode step and per
micro-batch) was measured in the embedded run and not kept: 59-65, 81-90 and 144-149 s over three
runs against 60, 85 and 150 s without it, within the VM's run-to-run spread.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

_OMP_PAUSE_SOFT = 1
_lookup_lock = threading.Lock()
_T = TypeVar("_T")
_pause: list[Callable[[int], int]] = []


def _mapped_libgomps() -> list[str]:
    """Paths of every GNU OpenMP runtime mapped into this process (torch's, and any other's)."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    paths = {line.split()[-1] for line in lines if "libgomp" in line and line.split()[-1].startswith("/")}
    return sorted(paths)


def _pause_functions() -> list[Callable[[int], int]]:
    """``omp_pause_resource_all`` of each loaded libgomp (looked up once some runtime is loaded)."""
    with _lookup_lock:
        if not _pause:
            _pause.extend(_find_pause_functions())
    return _pause


def _find_pause_functions() -> list[Callable[[int], int]]:
    found: list[Callable[[int], int]] = []
    for path in _mapped_libgomps():
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        except OSError:
            continue
        function = getattr(lib, "omp_pause_resource_all", None)
        if function is not None:
            function.argtypes, function.restype = [ctypes.c_int], ctypes.c_int
            found.append(function)
    return found


def release_threads() -> bool:
    """Free the calling thread's OpenMP worker pool (see the module docstring).

    Call it from a thread whose torch work is done for now, never inside a parallel region (it
    does nothing there). Returns whether a pool was released or none was held: ``False`` where no
    libgomp with ``omp_pause_resource_all`` is loaded (another OpenMP runtime, or none yet).
    """
    functions = _pause_functions()
    return bool(functions) and all(function(_OMP_PAUSE_SOFT) == 0 for function in functions)


def then_release(function: Callable[..., _T], /, *args: Any) -> _T:
    """``function(*args)``, then :func:`release_threads`: torch work handed to a thread that idles after it
    (``asyncio.to_thread(then_release, load, path)``)."""
    try:
        return function(*args)
    finally:
        release_threads()
