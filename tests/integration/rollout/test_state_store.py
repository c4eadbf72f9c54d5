"""The rollout's active set on SQLite and Postgres: persistence, leases, windows."""

from __future__ import annotations

from services.rollout.core.schedule import ActiveEnv, EnvStatus
from services.rollout.state_store import RolloutStateStore


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _env(env_id: str = "e1", first: int = 2, window: int = 3) -> ActiveEnv:
    return ActiveEnv(env_id, "game", "Optimization", f"d-{env_id}", first_version=first, window=window)


async def test_state_survives_reopening_the_store(state_url: str) -> None:
    store = RolloutStateStore.from_url(state_url)
    await store.register(_env())
    await store.observe_version(3)
    await store.complete("e1", 2)
    store.dispose()

    reopened = RolloutStateStore.from_url(state_url)  # a restarted service
    try:
        env = await reopened.get("e1")
        assert env is not None and env.played_through == 2 and env.status is EnvStatus.ACTIVE
        assert await reopened.latest_version() == 3
        claim = await reopened.claim_due("w1", 60)
        assert claim is not None and claim[1] == 3
    finally:
        reopened.dispose()


async def test_register_is_first_wins_and_latest_version_never_goes_down(state_url: str) -> None:
    store = RolloutStateStore.from_url(state_url)
    try:
        assert await store.latest_version() is None
        first = await store.register(_env(first=2))
        again = await store.register(_env(first=9))  # a re-delivered envs.ready after a newer version
        assert first == again and again.first_version == 2
        assert await store.observe_version(5) == 5
        assert await store.observe_version(4) == 5
        assert await store.observe_version(6) == 6
    finally:
        store.dispose()


async def test_a_due_version_is_leased_to_one_worker_until_the_lease_expires(state_url: str) -> None:
    clock = _Clock()
    store = RolloutStateStore.from_url(state_url, clock=clock)
    try:
        await store.register(_env())
        assert await store.claim_due("w1", 60) is None  # first plays follow the queue, not leases
        await store.complete("e1", 2)
        assert await store.claim_due("w1", 60) is None  # nothing newer published yet
        await store.observe_version(3)
        claim = await store.claim_due("w1", 60)
        assert claim is not None and claim[0].env_id == "e1" and claim[1] == 3
        assert await store.claim_due("w2", 60) is None  # leased
        clock.now += 61  # w1 died mid-play
        stolen = await store.claim_due("w2", 60)
        assert stolen is not None and stolen[1] == 3
        await store.complete("e1", 3)
        await store.complete("e1", 3)  # the dead worker finishing late changes nothing
        env = await store.get("e1")
        assert env is not None and env.played_through == 3
    finally:
        store.dispose()


async def test_windows_close_after_the_last_version_or_when_passed(state_url: str) -> None:
    store = RolloutStateStore.from_url(state_url)
    try:
        await store.register(_env("a", first=1, window=2))
        await store.register(_env("b", first=1, window=3))
        await store.register(_env("c", first=1, window=1))
        await store.complete("a", 1)
        await store.complete("b", 1)
        done_c = await store.complete("c", 1)
        assert done_c.status is EnvStatus.CLOSED  # a window of one closes with its first plays
        await store.observe_version(2)
        assert (await store.complete("a", 2)).status is EnvStatus.CLOSED
        await store.observe_version(5)  # b's window (1..3) passed without a play at 3
        closed = await store.close_passed_windows()
        assert {e.env_id for e in closed} == {"a", "b", "c"}
        for env in closed:
            await store.mark_retired(env.env_id)
        assert await store.close_passed_windows() == []
        assert {e.env_id for e in await store.envs(EnvStatus.RETIRED)} == {"a", "b", "c"}
        assert await store.claim_due("w", 60) is None
    finally:
        store.dispose()


async def test_a_failed_play_releases_its_lease(state_url: str) -> None:
    store = RolloutStateStore.from_url(state_url)
    try:
        await store.register(_env())
        await store.complete("e1", 2)
        await store.observe_version(3)
        assert await store.claim_due("w1", 600) is not None
        await store.release("e1", "w1")
        claim = await store.claim_due("w2", 600)
        assert claim is not None and claim[1] == 3
    finally:
        store.dispose()


async def test_a_live_worker_renews_its_lease_a_dead_one_cannot(state_url: str) -> None:
    clock = _Clock()
    store = RolloutStateStore.from_url(state_url, clock=clock)
    try:
        await store.register(_env())
        await store.complete("e1", 2)
        await store.observe_version(3)
        assert await store.claim_due("w1", 60) is not None
        clock.now += 50
        assert await store.extend("e1", "w1", 60)  # renewed: good until now + 60
        clock.now += 50
        assert await store.claim_due("w2", 60) is None
        clock.now += 11  # w1 stopped renewing
        assert not await store.extend("e1", "w1", 60)
        assert await store.claim_due("w2", 60) is not None
        assert not await store.extend("e1", "w1", 60)  # the lease is w2's now
    finally:
        store.dispose()
