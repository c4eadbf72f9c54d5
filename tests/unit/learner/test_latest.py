"""The ``latest`` pointer: what a restarted inference worker loads is the newest published version."""

from __future__ import annotations

import asyncio
from pathlib import Path

from services.learner.latest import point_latest
from services.learner.publisher import WeightPublisher
from spade.queues.inprocess import InProcessQueue


def test_latest_moves_forward_atomically_and_relative(tmp_path: Path) -> None:
    weights = tmp_path / "published"
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "config.json").write_text("{}")
    weights.mkdir()
    (weights / "latest").symlink_to("../base")  # what the place-weights Job leaves
    assert (weights / "latest" / "config.json").read_text() == "{}"
    for version in (1, 2):
        target = weights / f"v{version:08d}"
        target.mkdir()
        (target / "config.json").write_text(str(version))
        link = point_latest(weights, target)
        assert link.is_symlink() and not Path(link.readlink()).is_absolute()
        assert (link / "config.json").read_text() == str(version)
    assert sorted(p.name for p in weights.iterdir()) == ["latest", "v00000001", "v00000002"]  # no staging left


def test_publishing_a_version_points_latest_at_it(tmp_path: Path) -> None:
    async def run() -> None:
        queue = InProcessQueue()
        publisher = WeightPublisher([], queue, weights_dir=tmp_path)
        path = publisher.version_dir(3)
        path.mkdir()
        await publisher.publish(3, path)
        await publisher.close()

    asyncio.run(run())
    assert (tmp_path / "latest").resolve() == (tmp_path / "v00000003").resolve()


def test_the_published_version_is_what_latest_points_at_and_never_goes_back(tmp_path: Path) -> None:
    import pytest

    from services.learner.latest import AlreadyPublished, check_unpublished, published_version

    weights = tmp_path / "published"
    assert published_version(weights) == 0
    (tmp_path / "base").mkdir()
    weights.mkdir()
    (weights / "latest").symlink_to("../base")
    assert published_version(weights) == 0  # the base model placed by the deployment
    (weights / "v00000003").mkdir()
    point_latest(weights, weights / "v00000003")
    assert published_version(weights) == 3
    check_unpublished(weights, 4)
    check_unpublished(weights, 3, resuming=True)  # finishing its own interrupted publication
    for version in (3, 2):
        with pytest.raises(AlreadyPublished, match=f"weight version {version} cannot be published.*v3"):
            check_unpublished(weights, version)
