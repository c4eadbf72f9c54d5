"""Model location, conversion failures and settings: the checks that need no model weights."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.inference.settings import InferenceSettings
from spade.auth import KeyRing
from spade.inference import models


def test_cache_dir_is_overridable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(models.MODEL_CACHE_ENV, str(tmp_path / "m"))
    assert models.model_cache_dir() == tmp_path / "m"


def test_the_shipped_gguf_is_found_without_a_hard_coded_path() -> None:
    path = models.default_gguf_path()
    assert path.name == models.DEFAULT_GGUF_FILE and path.is_file()


def test_a_foreign_directory_in_the_cache_is_not_trusted(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(models.MODEL_CACHE_ENV, str(tmp_path))
    (tmp_path / models.DEFAULT_MODEL_NAME).mkdir()
    with pytest.raises(models.ModelError, match="not a finished conversion"):
        models.ensure_default_model()


def test_a_failed_conversion_leaves_nothing_behind(tmp_path: Path) -> None:
    garbage = tmp_path / "broken.gguf"
    garbage.write_bytes(b"not a gguf file")
    target = tmp_path / "cache" / "Broken"
    with pytest.raises(Exception):  # noqa: B017 - whatever the GGUF reader raises
        models.convert_gguf(garbage, target)
    assert not target.exists()
    assert list((tmp_path / "cache").iterdir()) == []


def test_a_configured_path_must_be_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(models.ModelError, match=r"config\.json"):
        models.resolve_model_path(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert models.resolve_model_path(tmp_path) == tmp_path


def test_settings_refuse_an_exposed_unauthenticated_server(monkeypatch: pytest.MonkeyPatch) -> None:
    from spade.auth import Role, hash_key

    assert InferenceSettings().http.host == "127.0.0.1"
    with pytest.raises(ValueError, match="exposes generation without a key"):
        InferenceSettings(http={"host": "0.0.0.0"})
    monkeypatch.setenv("SPADE_INFERENCE_HTTP__HOST", "0.0.0.0")
    with pytest.raises(ValueError, match="SPADE_INFERENCE_TRUSTED_NETWORK"):
        InferenceSettings()
    # Without admin keys the admin routes are off, whatever the host: nothing to refuse, a warning to give.
    unadministered = InferenceSettings(trusted_network=True)
    assert unadministered.keyring() is None
    warning = unadministered.admin_off_warning() or ""
    assert (
        "/update_weights_from_disk and /flush_cache answer 403" in warning and "SPADE_INFERENCE_ADMIN_KEYS" in warning
    )
    # A server that serves its start weights by design (an eval's, the warm start's) has nothing to warn about.
    fixed = InferenceSettings(trusted_network=True, fixed_weights=True)
    assert fixed.admin_off_warning() is None and fixed.keyring() is None
    admin = [{"tenant": "learner", "key_sha256": hash_key("admin")}]
    exposed = InferenceSettings(trusted_network=True, admin_keys=admin)
    assert exposed.admin_off_warning() is None
    assert exposed.http.address == "0.0.0.0:30000"  # one variable changed the host, the port kept its default
    assert [p.role for p in (exposed.keyring() or KeyRing({})).principals] == [Role.ADMIN]
    keyed = InferenceSettings(admin_keys=admin, api_keys=[{"tenant": "rollout", "key_sha256": hash_key("user")}])
    ring = keyed.keyring()
    assert ring is not None
    assert getattr(ring.verify("user"), "role", None) is Role.WRITE  # generates
    assert getattr(ring.verify("admin"), "role", None) is Role.ADMIN  # also swaps weights (and generates)
    with pytest.raises(ValueError, match="share one API key"):
        InferenceSettings(admin_keys=admin, api_keys=[{"tenant": "rollout", "key_sha256": hash_key("admin")}])
    assert InferenceSettings(dev_mode=True).http.host == "0.0.0.0"


def test_settings_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPADE_INFERENCE_MAX_BATCH_SIZE", "0")
    with pytest.raises(ValueError, match="max_batch_size"):
        InferenceSettings()
