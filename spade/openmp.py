"""GNU OpenMP's thread pools: idle threads give their workers back, and busy ones share the CPUs.

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
a core another team needs would cost more than the sleep. Better still, they share the CPUs instead
of each running a full team on them: a team that waits at a barrier for a worker the kernel has
parked behind another team's thread loses a time slice. A thread that computes in bursts (the
engine's scheduler, the learner's step) says so (:func:`computing` and :func:`done_computing`) and takes
its :func:`share` of the threads it wants: that count divided among the teams computing now. In the
embedded run on 2 cores (the engine and the learner in one process) the default three steps took
59-65, 81-90 and 144-149 s with shares (three runs), against 60, 85 and 150 s with the idle pools
freed alone (one run; sharing's gain is within the spread) and 76, 92 and 154 s before either (same
tokens).
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable
from pathlib import Path

import torch

_OMP_PAUSE_SOFT = 1
_computing: dict[int, int] = {}  # thread ident -> the torch threads it wants
_computing_lock = threading.Lock()
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
    with _computing_lock:
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


def computing() -> None:
    """Count the calling thread's team among those computing now, until :func:`done_computing`.

    The thread's torch threads at its first call are what it wants (:func:`share` divides them).
    """
    with _computing_lock:
        _computing.setdefault(threading.get_ident(), torch.get_num_threads())


def done_computing() -> None:
    """The calling thread's team computes no more for now: its threads back to what it wanted, its
    OpenMP workers released."""
    with _computing_lock:
        wanted = _computing.pop(threading.get_ident(), None)
    if wanted is not None and torch.get_num_threads() != wanted:
        torch.set_num_threads(wanted)
    release_threads()


def share() -> int:
    """Set the calling thread's torch threads to its share of the CPUs now; returns them.

    A thread counted by :func:`computing` gets the threads it wanted divided among the teams
    computing now (at least 1); any other thread keeps its own. torch's count is set only when it
    changes.
    """
    ident = threading.get_ident()
    with _computing_lock:
        wanted, teams = _computing.get(ident), len(_computing)
    if wanted is None:
        return torch.get_num_threads()
    threads = max(1, wanted // teams)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)  # this thread's OpenMP count (and MKL's)
    return threads
