"""A (re)starting inference server serves what the learner published, reporting its version."""

from __future__ import annotations

from pathlib import Path

from services.inference.settings import InferenceSettings
from services.inference.wiring import starting_weights
from services.learner.latest import point_latest


def _settings(**values: object) -> InferenceSettings:
    return InferenceSettings(dev_mode=True, **values)  # type: ignore[arg-type]


def test_before_the_first_publish_it_starts_from_the_model_path(tmp_path: Path) -> None:
    base = tmp_path / "base"
    base.mkdir()
    weights = tmp_path / "weights"
    assert starting_weights(_settings(model_path=base, published_weights_dir=weights)) == (base, "0")
    # A pointer at the base model (a deployment's place-weights step) is not a published version.
    point_latest(weights, base)
    assert starting_weights(_settings(model_path=base, published_weights_dir=weights)) == (base, "0")


def test_after_a_publish_it_serves_the_newest_version_and_reports_it(tmp_path: Path) -> None:
    weights = tmp_path / "weights"
    for number in (1, 2):
        (weights / f"v{number:08d}").mkdir(parents=True)
        point_latest(weights, weights / f"v{number:08d}")
    started = starting_weights(_settings(model_path=tmp_path, published_weights_dir=weights))
    assert started == ((weights / "v00000002").resolve(), "2")
    # Without the setting the server keeps its model path and configured version.
    assert starting_weights(_settings(model_path=tmp_path, weight_version="7")) == (tmp_path, "7")
