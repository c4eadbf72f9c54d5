"""The quota contract, run against every store: this replica's (``LocalQuotas``) and Redis's.

Redis is the real one on the machine; each test gets its own key prefix.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from services.sandbox.core.auth import Tenant
from services.sandbox.core.errors import QuotaExceeded, ServiceUnavailable
from services.sandbox.core.quotas import LocalQuotas, QuotaStore
from services.sandbox.redis_quotas import RedisQuotas
from services.sandbox.settings import RedisQuotaSettings

ALICE = Tenant(name="alice", max_sessions=2, executions_per_minute=3)
BOB = Tenant(name="bob", max_sessions=1, executions_per_minute=1)


def redis_settings(**overrides: object) -> RedisQuotaSettings:
    return RedisQuotaSettings(prefix=f"spade-test:quota:{uuid.uuid4().hex}", **overrides)


@pytest_asyncio.fixture(params=["local", pytest.param("redis", marks=pytest.mark.redis)])
async def quotas(request: pytest.FixtureRequest) -> AsyncIterator[QuotaStore]:
    store: QuotaStore = LocalQuotas() if request.param == "local" else RedisQuotas(redis_settings())
    try:
        yield store
    finally:
        await store.close()


async def test_sessions_count_per_tenant_and_release_once(quotas: QuotaStore) -> None:
    await quotas.acquire_session(ALICE, "s1")
    await quotas.acquire_session(ALICE, "s1")  # the same session twice is held once
    await quotas.acquire_session(ALICE, "s2")
    with pytest.raises(QuotaExceeded, match="holds 2 open sessions, its limit is 2") as refused:
        await quotas.acquire_session(ALICE, "s3")
    assert refused.value.retry_after_s > 0
    await quotas.acquire_session(BOB, "b1")  # tenants do not share
    await quotas.release_session(ALICE, "s1")
    await quotas.release_session(ALICE, "s1")  # idempotent: frees one slot, not two
    await quotas.release_session(ALICE, "never-held")
    await quotas.acquire_session(ALICE, "s3")
    with pytest.raises(QuotaExceeded):
        await quotas.acquire_session(ALICE, "s4")


async def test_runs_per_minute_refuse_with_when_to_retry(quotas: QuotaStore) -> None:
    for _ in range(3):
        await quotas.charge_run(ALICE)
    with pytest.raises(QuotaExceeded, match="reached 3 runs") as refused:
        await quotas.charge_run(ALICE)
    assert 0 < refused.value.retry_after_s <= 60
    await quotas.charge_run(BOB)
    with pytest.raises(QuotaExceeded):
        await quotas.charge_run(BOB)


@pytest.mark.redis
async def test_two_stores_on_one_redis_share_each_quota() -> None:
    settings = redis_settings()
    first, second = RedisQuotas(settings), RedisQuotas(settings)
    try:
        await first.charge_run(ALICE)
        await second.charge_run(ALICE)
        await first.charge_run(ALICE)
        with pytest.raises(QuotaExceeded):
            await second.charge_run(ALICE)
        await first.acquire_session(BOB, "b1")
        with pytest.raises(QuotaExceeded):
            await second.acquire_session(BOB, "b2")
        # Both replicas race for the last slots: exactly the quota is handed out.
        results = await asyncio.gather(
            *(store.acquire_session(ALICE, f"race-{i}") for i, store in enumerate([first, second] * 4)),
            return_exceptions=True,
        )
        assert sum(r is None for r in results) == ALICE.max_sessions
    finally:
        await first.close()
        await second.close()


@pytest.mark.redis
async def test_a_dead_replicas_sessions_stop_counting_when_their_lease_ends() -> None:
    settings = redis_settings()
    dead, alive = RedisQuotas(settings), RedisQuotas(settings)
    dead._lease_ms = alive._lease_ms = 300  # the settings' floor is 5 s; the mechanism is the same
    try:
        await dead.acquire_session(BOB, "b1")
        await alive.acquire_session(ALICE, "a1")
        for _ in range(3):
            await asyncio.sleep(0.15)
            await alive.renew_sessions({"a1": ALICE})  # the live replica renews; the dead one never does
        await alive.acquire_session(BOB, "b2")  # b1's lease ran out
        await alive.acquire_session(ALICE, "a2")
        with pytest.raises(QuotaExceeded):  # a1 still counts: it was renewed
            await alive.acquire_session(ALICE, "a3")
    finally:
        await dead.close()
        await alive.close()


async def test_an_unreachable_redis_refuses_rather_than_letting_everyone_in() -> None:
    store = RedisQuotas(RedisQuotaSettings(url="redis://127.0.0.1:1/0", socket_timeout_s=0.5))
    try:
        with pytest.raises(ServiceUnavailable, match="quota store"):
            await store.charge_run(ALICE)
        with pytest.raises(ServiceUnavailable):
            await store.acquire_session(ALICE, "s")
    finally:
        await store.close()
