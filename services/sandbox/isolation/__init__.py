"""The sandbox's isolation core: a pre-warmed, isolated zygote that runs untrusted code.

Public API (see ``docs/sandbox-isolation.md``):

- ``IsolationSettings``: layers, identity and limits.
- ``probe_layers(settings)`` / ``LayerStatus`` / ``SandboxUnavailable``: what isolation this host offers.
- ``SandboxPool``: ``start``/``stop``/``health``, ``execute``, ``validate``, ``open_session``.
- ``ExecLimits``, ``ExecStatus``, ``ExecutionResult``, ``SandboxSession``, ``SandboxFault``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from services.sandbox.isolation.settings import IsolationSettings

if TYPE_CHECKING:
    from services.sandbox.isolation.layers import LayerStatus, SandboxUnavailable, probe_layers
    from services.sandbox.isolation.outcomes import ExecLimits, ExecStatus, ExecutionResult, SandboxFault
    from services.sandbox.isolation.pool import SandboxPool, SandboxSession

_LAZY = {
    "LayerStatus": "layers",
    "SandboxUnavailable": "layers",
    "probe_layers": "layers",
    "ExecLimits": "outcomes",
    "ExecStatus": "outcomes",
    "ExecutionResult": "outcomes",
    "SandboxFault": "outcomes",
    "SandboxPool": "pool",
    "SandboxSession": "pool",
}

__all__ = [
    "ExecLimits",
    "ExecStatus",
    "ExecutionResult",
    "IsolationSettings",
    "LayerStatus",
    "SandboxFault",
    "SandboxPool",
    "SandboxSession",
    "SandboxUnavailable",
    "probe_layers",
]


def __getattr__(name: str) -> Any:
    # The settings are imported by every service's settings module; the pool (asyncio, subprocess
    # plumbing) only by the service that runs code, so load it on first use.
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
