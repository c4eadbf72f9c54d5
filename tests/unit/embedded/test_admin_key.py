"""The embedded run's inference admin key: made per run, handed to its learner only (issue 20).

The inference server's admin routes are off without an admin key; ``make run`` keeps publishing
weights because ``embedded_system`` adds a key of the run's own to the server's ``admin_keys`` and
``role_settings`` hands it to the learner (the designer and the rollout never hold it).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from services.embedded.roles import role_settings
from services.embedded.settings import RunSettings
from services.embedded.system import RUN_LEARNER, inference_settings, served_weights
from services.inference import rows
from spade import cpu_linear
from spade.auth import Role, hash_key


def test_the_learner_gets_the_run_s_admin_key_and_no_one_else(tmp_path: Path) -> None:
    roles = role_settings(
        RunSettings(run_dir=tmp_path), inference_url="http://127.0.0.1:1", model=tmp_path / "m", admin_key="run-key"
    )
    assert roles.learner.inference.key() == "run-key"
    assert roles.designer.inference.key() is None and roles.rollout.inference.key() is None


def test_a_learner_section_with_its_own_key_keeps_it_and_its_tls(tmp_path: Path) -> None:
    told = RunSettings(run_dir=tmp_path, learner={"inference": {"api_key": "operator-key"}})
    roles = role_settings(told, inference_url="http://127.0.0.1:1", model=tmp_path / "m", admin_key="run-key")
    assert roles.learner.inference.key() == "operator-key"
    (tmp_path / "ca.pem").write_text("")
    no_key = RunSettings(run_dir=tmp_path, learner={"inference": {"tls": {"ca_file": str(tmp_path / "ca.pem")}}})
    roles = role_settings(no_key, inference_url="http://127.0.0.1:1", model=tmp_path / "m", admin_key="run-key")
    assert roles.learner.inference.key() == "run-key" and roles.learner.inference.tls is not None


def test_the_run_s_inference_server_takes_the_key_besides_any_configured(tmp_path: Path) -> None:
    server = inference_settings(RunSettings(run_dir=tmp_path), tmp_path / "m", hash_key("run-key"))
    assert server.admin_off_warning() is None  # the admin routes are on: the learner can publish
    ring = server.keyring()
    assert ring is not None and getattr(ring.verify("run-key"), "tenant", None) == RUN_LEARNER
    assert getattr(ring.verify("run-key"), "role", None) is Role.ADMIN and ring.verify("other") is None
    configured = RunSettings(
        run_dir=tmp_path, inference={"admin_keys": [{"tenant": "ops", "key_sha256": hash_key("ops-key")}]}
    )
    both = inference_settings(configured, tmp_path / "m", hash_key("run-key")).keyring()
    assert both is not None and both.verify("ops-key") is not None and both.verify("run-key") is not None


@pytest.mark.parametrize(("native", "kernel"), [(True, False), (False, True), (False, False)])
def test_the_run_serves_bf16_weights_where_the_cpu_multiplies_bf16_or_the_engines_kernel_takes_every_decode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, native: bool, kernel: bool
) -> None:
    monkeypatch.setattr(cpu_linear, "native_bf16", lambda: native)  # the CPU's capability, every way
    monkeypatch.setattr(rows, "serves_every_bf16_decode", lambda: kernel)
    server = inference_settings(RunSettings(run_dir=tmp_path), tmp_path / "m", hash_key("run-key"))
    expected = "bf16" if native or kernel else "float32"
    assert server.weights == served_weights(RunSettings(run_dir=tmp_path)) == expected
    for told in ("float32", "int8"):
        run = RunSettings(run_dir=tmp_path, inference={"weights": told})
        assert inference_settings(run, tmp_path / "m", hash_key("run-key")).weights == served_weights(run) == told
