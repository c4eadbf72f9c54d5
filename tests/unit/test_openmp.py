"""spade.openmp: a thread gives its OpenMP workers back, and gets new ones on its next parallel region."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest
import torch

from spade import openmp

pytestmark = pytest.mark.skipif(not openmp._mapped_libgomps(), reason="torch here does not run on GNU OpenMP")


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _settled(expected: int) -> int:
    """The process's thread count once it reaches ``expected`` (an exiting worker leaves shortly), or after 10 s."""
    deadline = time.monotonic() + 10.0
    while _threads() != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return _threads()


def _in_thread(body: Any) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    thread = threading.Thread(target=body, args=(seen,))
    thread.start()
    thread.join()
    return seen


def _parallel_region() -> None:
    torch.ones(4_000_000).add_(1.0)  # far above torch's grain size: two threads run it


def test_release_ends_the_calling_threads_workers_and_the_next_region_starts_new_ones() -> None:
    def body(seen: dict[str, Any]) -> None:
        torch.set_num_threads(3)  # this thread only: 2 workers beside it, even on a 1-CPU machine
        seen["before"] = _threads()
        _parallel_region()
        seen["pooled"] = _threads()
        seen["released"] = openmp.release_threads()
        seen["after"] = _settled(seen["before"])
        _parallel_region()
        seen["again"] = _threads()
        openmp.release_threads()

    seen = _in_thread(body)
    assert seen["pooled"] == seen["before"] + 2
    assert seen["released"] is True
    assert seen["after"] == seen["before"]
    assert seen["again"] == seen["before"] + 2


def test_release_leaves_another_threads_workers_alone() -> None:
    pooled = threading.Event()
    go_on = threading.Event()
    seen: dict[str, Any] = {}

    def holder() -> None:
        torch.set_num_threads(2)
        _parallel_region()
        seen["holding"] = _threads()
        pooled.set()
        go_on.wait(30)
        openmp.release_threads()

    thread = threading.Thread(target=holder)
    thread.start()
    try:
        assert pooled.wait(30)
        releasing = _in_thread(lambda own: own.update(released=openmp.release_threads()))
        assert releasing["released"] is True
        assert _settled(seen["holding"]) == seen["holding"]  # the holder's worker is still there
    finally:
        go_on.set()
        thread.join()


def test_a_computing_team_gets_its_share_of_the_threads_and_all_of_them_alone() -> None:
    other_computing = threading.Event()
    other_may_stop = threading.Event()

    def other() -> None:
        torch.set_num_threads(2)
        openmp.computing()
        other_computing.set()
        other_may_stop.wait(30)
        openmp.done_computing()

    def body(seen: dict[str, Any]) -> None:
        seen["ident"] = threading.get_ident()
        torch.set_num_threads(4)
        seen["unregistered"] = openmp.share()  # a thread that never said it computes keeps its own
        openmp.computing()
        seen["alone"] = (openmp.share(), torch.get_num_threads())
        thread = threading.Thread(target=other)
        thread.start()
        assert other_computing.wait(30)
        seen["beside"] = (openmp.share(), torch.get_num_threads())
        other_may_stop.set()
        thread.join()
        seen["alone_again"] = (openmp.share(), torch.get_num_threads())
        openmp.computing()  # a second call keeps what the thread first wanted
        torch.set_num_threads(1)
        seen["still_four"] = openmp.share()
        torch.set_num_threads(2)
        openmp.done_computing()
        seen["restored"] = torch.get_num_threads()

    seen = _in_thread(body)
    assert seen["unregistered"] == 4
    assert seen["alone"] == (4, 4)
    assert seen["beside"] == (2, 2)
    assert seen["alone_again"] == (4, 4)
    assert seen["still_four"] == 4
    assert seen["restored"] == 4  # done: back to the threads it wanted
    assert seen["ident"] not in openmp._computing  # done: no longer counted


def test_a_share_is_never_below_one_thread() -> None:
    def body(seen: dict[str, Any]) -> None:
        torch.set_num_threads(1)
        openmp.computing()
        others = [threading.Thread(target=openmp.computing) for _ in range(2)]  # they never say done
        for thread in others:
            thread.start()
            thread.join()
        seen["share"] = openmp.share()
        with openmp._computing_lock:
            for thread in others:
                openmp._computing.pop(thread.ident or 0, None)
        openmp.done_computing()

    assert _in_thread(body)["share"] == 1
