"""Auth rules of the sandbox service and the local quota's clock (pure core); the quota contract over
every store is in tests/integration/sandbox/test_quotas.py."""

from __future__ import annotations

import pytest

from services.sandbox.core.auth import DEV_TENANT, KeyRing, Tenant, hash_key, tenant_keyring
from services.sandbox.core.errors import QuotaExceeded, Unauthenticated
from services.sandbox.core.quotas import LocalQuotas

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


async def test_local_run_rate_is_a_rolling_minute() -> None:
    now = [1000.0]
    quotas = LocalQuotas(clock=lambda: now[0])
    for _ in range(3):
        await quotas.charge_run(ALICE)
    with pytest.raises(QuotaExceeded, match="retry in 60 s") as refused:
        await quotas.charge_run(ALICE)
    assert refused.value.retry_after_s == 60.0
    now[0] += 59.0
    with pytest.raises(QuotaExceeded) as refused:
        await quotas.charge_run(ALICE)
    assert refused.value.retry_after_s == pytest.approx(1.0)
    now[0] += 1.5
    await quotas.charge_run(ALICE)
