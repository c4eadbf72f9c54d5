"""The ``latest`` pointer of the published weights: ``<weights_dir>/latest`` -> the newest version.

An inference worker that restarts (an SGLang pod rescheduled, the embedded server redeployed)
starts from ``<weights_dir>/latest`` (the deployments pass it as the model path), so it serves
the newest published weights rather than the base model. The pointer is a relative symlink,
replaced atomically (a new link renamed over the old one): a reader sees the old version or the
new one, never a missing or half-written pointer. Before the first publish, the deployment's
place-weights step points it at the base model. Reading the pointer is
:mod:`spade.inference.published` (an inference server reads it too); moving it is here.
"""

from __future__ import annotations

import os
from pathlib import Path

from spade.inference.published import LATEST, published_version


def point_latest(weights_dir: Path, version_dir: Path) -> Path:
    """Make ``weights_dir/latest`` point at ``version_dir`` (a link relative to ``weights_dir``).

    Returns:
        The pointer's path.
    """
    weights_dir = Path(weights_dir)
    link = weights_dir / LATEST
    target = Path(os.path.relpath(Path(version_dir).resolve(), weights_dir.resolve()))
    weights_dir.mkdir(parents=True, exist_ok=True)
    staging = weights_dir / f".{LATEST}.{os.getpid()}"
    staging.unlink(missing_ok=True)
    staging.symlink_to(target, target_is_directory=True)
    os.replace(staging, link)
    return link


class AlreadyPublished(RuntimeError):
    """A version at or below the newest published one was about to be published again."""


def check_unpublished(weights_dir: Path, version: int, *, resuming: bool = False) -> None:
    """Refuse to publish ``version`` when it (or a newer one) was already published.

    Args:
        weights_dir: The published versions' root.
        version: The version about to be written and published.
        resuming: Completing the interrupted publication of ``version`` itself (allowed when
            ``latest`` already points at it).

    Raises:
        AlreadyPublished: ``version`` <= the published version (naming both and the fix).
    """
    published = published_version(weights_dir)
    if version < published or (version == published and not resuming):
        raise AlreadyPublished(
            f"weight version {version} cannot be published: {weights_dir}/{LATEST} already points at "
            f"v{published}, and published versions only go forward; resume the learner from the checkpoint "
            "of that version (its checkpoint_dir) or use a fresh weights_dir for a new run"
        )
