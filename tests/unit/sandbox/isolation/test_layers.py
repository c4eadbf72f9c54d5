"""Layer probing on this host, and the refusal to start when a required layer is missing."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.sandbox.isolation import IsolationSettings, SandboxPool, SandboxUnavailable, probe_layers
from services.sandbox.isolation.layers import LAYERS, LayerStatus, require_layers


@pytest.mark.sandbox
def test_every_layer_is_available_on_this_host() -> None:
    layers = probe_layers(IsolationSettings())
    assert set(layers) == set(LAYERS)
    assert {name: s.available for name, s in layers.items()} == dict.fromkeys(LAYERS, True), layers


@pytest.mark.sandbox
@pytest.mark.parametrize(
    ("override", "layer", "detail"),
    [
        ({"bwrap": "/nonexistent/bwrap"}, "bwrap", "install bubblewrap"),
        ({"setpriv": "/nonexistent/setpriv"}, "setpriv", "install util-linux"),
        ({"seccomp_path": "/nonexistent"}, "seccomp", "python3-seccomp"),
        ({"python": "/nonexistent/python3"}, "python", "not an executable file"),
    ],
)
def test_a_missing_layer_is_named_with_its_fix(override: dict[str, str], layer: str, detail: str) -> None:
    layers = probe_layers(IsolationSettings.model_validate(override))
    assert not layers[layer].available
    assert detail in layers[layer].detail
    others = [name for name in ("bwrap", "setpriv", "seccomp") if layer not in (name, "python")]
    assert all(layers[name].available for name in others), layers


def test_require_layers_refuses_unless_allowed() -> None:
    layers = {
        "python": LayerStatus(True, "ok"),
        "bwrap": LayerStatus(False, "gone"),
        "seccomp": LayerStatus(False, "off"),
    }
    with pytest.raises(SandboxUnavailable) as caught:
        require_layers(IsolationSettings(), layers)
    message = str(caught.value)
    assert "bwrap (gone)" in message and "seccomp (off)" in message
    assert "ALLOW_DEGRADED" in message and set(caught.value.missing) == {"bwrap", "seccomp"}
    with pytest.raises(SandboxUnavailable) as partly:
        require_layers(IsolationSettings(allow_degraded=["bwrap"]), layers)
    assert set(partly.value.missing) == {"seccomp"}
    assert require_layers(IsolationSettings(allow_degraded=["bwrap", "seccomp"]), layers) == ["bwrap", "seccomp"]


@pytest.mark.sandbox
async def test_pool_refuses_to_start_without_a_layer_and_leaves_nothing_running() -> None:
    pool = SandboxPool(IsolationSettings(bwrap=Path("/nonexistent/bwrap")))
    with pytest.raises(SandboxUnavailable, match=r"missing isolation layers: bwrap"):
        await pool.start()
    assert pool.health()["status"] == "down"
    assert pool.instance is None  # nothing staged, nothing launched


@pytest.mark.sandbox
async def test_pool_without_python_cannot_be_degraded() -> None:
    pool = SandboxPool(
        IsolationSettings(python=Path("/nonexistent/python3"), allow_degraded=["bwrap", "userns", "seccomp"])
    )
    with pytest.raises(SandboxUnavailable, match="python"):
        await pool.start()


@pytest.mark.sandbox
@pytest.mark.slow
async def test_degraded_mode_runs_without_the_layer_and_says_so() -> None:
    settings = IsolationSettings(seccomp_path=Path("/nonexistent"), allow_degraded=["seccomp"])
    async with SandboxPool(settings) as pool:
        health = pool.health()
        assert health["status"] == "degraded" and health["degraded"] == ["seccomp"]
        assert not health["layers"]["seccomp"]["available"]
        result = await pool.execute("print(open('/proc/self/status').read().split('Seccomp:')[1].split()[0])")
        assert result.stdout == b"0\n"  # no filter loaded: that is what degraded means
        # Every other layer still holds: namespaces, the uid, the read-only view.
        other = await pool.execute("import os; print(os.getuid(), os.access('/usr', os.W_OK))")
        assert other.stdout == b"65534 False\n"
