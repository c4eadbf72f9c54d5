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


def test_then_release_returns_the_result_and_ends_the_workers_even_when_the_work_fails() -> None:
    def work(value: int) -> int:
        _parallel_region()
        return value + 1

    def fails() -> None:
        _parallel_region()
        raise ValueError("the work failed")

    def body(seen: dict[str, Any]) -> None:
        torch.set_num_threads(2)
        seen["before"] = _threads()
        seen["result"] = openmp.then_release(work, 41)
        seen["after"] = _settled(seen["before"])
        with pytest.raises(ValueError, match="the work failed"):
            openmp.then_release(fails)
        seen["after_failure"] = _settled(seen["before"])

    seen = _in_thread(body)
    assert seen["result"] == 42
    assert seen["after"] == seen["before"]
    assert seen["after_failure"] == seen["before"]
