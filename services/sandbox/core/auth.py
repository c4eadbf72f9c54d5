"""Who may call the sandbox: tenants with quotas, identified by their API keys (``spade.auth``)."""

from __future__ import annotations

from dataclasses import dataclass

from spade.auth import DEFAULT_ROLE, KeyRing, Role, hash_key

__all__ = ["DEV_TENANT", "KeyRing", "Tenant", "hash_key", "tenant_keyring"]


@dataclass(frozen=True)
class Tenant:
    """A caller identity with its quotas and its role (``write`` runs code; ``read`` only reads
    ``/healthz/details`` and ``/metrics``; ``spade.auth.authorize`` decides)."""

    name: str
    max_sessions: int
    executions_per_minute: int
    role: Role = DEFAULT_ROLE


DEV_TENANT = Tenant(name="dev", max_sessions=64, executions_per_minute=6000, role=Role.ADMIN)
"""Who an anonymous caller is in dev mode (no keys configured)."""


def tenant_keyring(tenants: dict[str, Tenant], *, dev_mode: bool) -> KeyRing[Tenant]:
    """The tenants by key digest; in dev mode without any key the API is open (as ``DEV_TENANT``)."""
    return KeyRing(tenants, anonymous=DEV_TENANT if dev_mode else None)
