"""The published weights as every reader sees them: ``<weights_dir>/latest`` -> ``v<N>``.

The learner writes each version to ``<weights_dir>/v<N>`` and moves the ``latest`` pointer (a
relative symlink, replaced atomically) before it tells any inference worker to load it. Readers:
the learner itself (it never publishes a version at or below ``latest``), and an inference server
that restarts, which serves ``latest`` and reports its version instead of the base model at version
0 (the rollout would otherwise play new slots on old weights until the next publication, and past
``max_staleness`` every group would be dropped and nothing would train again).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

LATEST = "latest"

_VERSION_DIR = re.compile(r"^v(\d+)$")


def published_version(weights_dir: Path) -> int:
    """The version ``weights_dir/latest`` points at: the newest one ever published (0 before the first).

    ``latest`` moves before any worker is told to load a version, so every version a worker may serve
    is at most this one. A pointer at anything but a ``v<N>`` directory (the base model placed by the
    deployment) means nothing was published yet.
    """
    link = Path(weights_dir) / LATEST
    if not link.is_symlink():
        return 0
    match = _VERSION_DIR.match(Path(os.readlink(link)).name)
    return int(match.group(1)) if match else 0


def published_model(weights_dir: Path) -> tuple[Path, int] | None:
    """The directory and number of the newest published version, or ``None`` before the first."""
    version = published_version(weights_dir)
    if version == 0:
        return None
    return (Path(weights_dir) / LATEST).resolve(), version
