"""C++ extensions the project compiles once per machine: the inference engine's decode kernel
(``services/inference/rows.py``) and the causal attention that prompts and the learner share
(:mod:`spade.attention`).

Each is compiled once per source and torch version (``torch.utils.cpp_extension``, under a minute with
g++; ``make install`` builds them) into ``$SPADE_KERNEL_CACHE`` (default ``~/.cache/spade/kernels``).
:func:`build` raises where that fails; its callers keep torch's operators then and say why.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

from spade.inference.models import spade_cache_dir

logger = logging.getLogger(__name__)

#: Compiler and linker flags: optimised, and OpenMP for ``at::parallel_for`` (at run time it resolves to
#: the libgomp torch has already loaded, so the kernel's threads are torch's own pool).
CFLAGS = ("-O3", "-fopenmp")
LDFLAGS = ("-fopenmp",)

#: A build lock (torch's ``FileBaton``, a file in the build directory) older than this was left by a
#: build that died (a build takes under a minute): it is removed, or every later build would wait forever.
STALE_LOCK_S = 600.0


def cache_dir() -> Path:
    """Where compiled kernels live (``$SPADE_KERNEL_CACHE`` or ``~/.cache/spade/kernels``)."""
    return spade_cache_dir("kernels", "SPADE_KERNEL_CACHE")


def build_name(source: Path, prefix: str) -> str:
    """The module's name: the source's, the flags', torch's and Python's identity, so a change of any builds anew."""
    versions = (CFLAGS, LDFLAGS, torch.__version__, sys.implementation.cache_tag)
    identity = source.read_bytes() + repr(versions).encode()
    return f"{prefix}_{hashlib.sha256(identity).hexdigest()[:16]}"


def build(source: Path, prefix: str) -> ModuleType:
    """Compile ``source`` (or load it, compiled before) as a torch extension named ``prefix_<hash>``.

    Raises:
        Exception: No compiler or ninja, or the build failed (torch's own error).
    """
    name = build_name(source, prefix)
    directory = cache_dir() / name
    from torch.utils.cpp_extension import load

    directory.mkdir(parents=True, exist_ok=True)
    _remove_stale_lock(directory / "lock")
    with _ninja_on_path():
        return load(
            name=name,
            sources=[str(source)],
            extra_cflags=list(CFLAGS),
            extra_ldflags=list(LDFLAGS),
            build_directory=str(directory),
        )


def _remove_stale_lock(lock: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        age = time.time() - lock.stat().st_mtime
        if age > STALE_LOCK_S:
            logger.warning("removing %s, left %.0f s ago by a build that did not finish", lock, age)
            lock.unlink()


@contextlib.contextmanager
def _ninja_on_path() -> Iterator[None]:
    """torch builds with ``ninja`` from ``PATH``; a virtualenv's (the ``ninja`` package) is there only if
    activated, so its directory is put first for the build, and ``PATH`` restored after it."""
    before = os.environ.get("PATH")
    if shutil.which("ninja") is None:
        with contextlib.suppress(ImportError):
            import ninja

            os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, before or ""])
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = before
