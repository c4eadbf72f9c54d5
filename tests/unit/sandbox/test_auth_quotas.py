"""Auth and quota rules of the sandbox service (pure core)."""

from __future__ import annotations

import pytest

from services.sandbox.core.auth import DEV_TENANT, KeyRing, Tenant, hash_key, tenant_keyring
from services.sandbox.core.errors import QuotaExceeded, Unauthenticated
from services.sandbox.core.quotas import Quotas

ALICE = Tenant(name="alice", max_sessions=2, executions_per_minute=3)


def test_known_key_maps_to_its_tenant() -> None:
    auth = KeyRing({hash_key("k-alice"): ALICE})
    assert auth.authenticate("Bearer k-alice") is ALICE
    assert auth.authenticate("bearer   k-alice ") is ALICE


@pytest.mark.parametrize("header", [None, "", "k-alice", "Basic k-alice", "Bearer ", "Bearer k-bob", "Bearer K-ALICE"])
def test_missing_malformed_or_unknown_keys_are_refused(header: str | None) -> None:
    auth = KeyRing({hash_key("k-alice"): ALICE})
    with pytest.raises(Unauthenticated):
        auth.authenticate(header)


def test_anonymous_only_in_dev_mode_without_keys() -> None:
    assert tenant_keyring({}, dev_mode=True).authenticate(None) is DEV_TENANT
    with pytest.raises(Unauthenticated):
        tenant_keyring({}, dev_mode=False).authenticate(None)
    with pytest.raises(Unauthenticated):  # a configured key closes dev mode's open door
        tenant_keyring({hash_key("k-alice"): ALICE}, dev_mode=True).authenticate(None)


def test_session_quota_counts_and_releases() -> None:
    quotas = Quotas()
    quotas.acquire_session(ALICE)
    quotas.acquire_session(ALICE)
    with pytest.raises(QuotaExceeded, match="limit is 2"):
        quotas.acquire_session(ALICE)
    quotas.release_session(ALICE)
    quotas.acquire_session(ALICE)
    assert quotas.sessions_held(ALICE) == 2


def test_execution_rate_is_a_rolling_minute() -> None:
    now = [1000.0]
    quotas = Quotas(clock=lambda: now[0])
    for _ in range(3):
        quotas.charge_run(ALICE)
    with pytest.raises(QuotaExceeded, match="retry in"):
        quotas.charge_run(ALICE)
    now[0] += 59.0
    with pytest.raises(QuotaExceeded):
        quotas.charge_run(ALICE)
    now[0] += 1.5
    quotas.charge_run(ALICE)


def test_tenants_do_not_share_quota() -> None:
    bob = Tenant(name="bob", max_sessions=1, executions_per_minute=1)
    quotas = Quotas()
    quotas.charge_run(bob)
    quotas.charge_run(ALICE)
    with pytest.raises(QuotaExceeded):
        quotas.charge_run(bob)
