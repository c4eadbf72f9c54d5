"""The rollout's state on SQLite and Postgres: windows by slot, leases that follow liveness, finished plays."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest

from services.rollout.core.schedule import ActiveEnv, EnvStatus
from services.rollout.state_store import RolloutStateStore
from spade.retry import RetryPolicy


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _env(env_id: str = "e1", design: int = 2, window: int = 3) -> ActiveEnv:
    return ActiveEnv(env_id, "game", "Optimization", f"d-{env_id}", window=window, design_version=design, spec_id="s")


async def test_state_survives_reopening_the_store(state_url: str) -> None:
    store = RolloutStateStore.from_url(state_url)
    await store.register(_env())
    await store.observe_version(3)
    await store.fix_window("e1", 3, 3)
    await store.mark_play_done("e1@s0/plain/7", "e1", 0)
    await store.complete_slot("e1", 0)
    store.dispose()

    reopened = RolloutStateStore.from_url(state_url)  # a restarted service
    try:
        env = await reopened.get("e1")
        assert env is not None and (env.window_start, env.slots_done, env.status) == (3, 1, EnvStatus.ACTIVE)
        assert env.spec_id == "s" and env.design_version == 2
        assert await reopened.latest_version() == 3
        assert await reopened.done_plays("e1", 0) == {"e1@s0/plain/7"}
        assert await reopened.claim("w1", 60) is None  # slot 1 belongs to version 4, not published yet
        await reopened.observe_version(4)
        claim = await reopened.claim("w1", 60)
        assert claim is not None and (claim.slot, claim.attempts) == (1, 1)
    finally:
        reopened.dispose()


async def test_register_is_first_wins_and_latest_version_never_goes_down(state_url: str) -> None:
    store = RolloutStateStore.from_url(state_url)
    try:
        assert await store.latest_version() is None
        first = await store.register(_env(design=2))
        again = await store.register(_env(design=9))  # a re-delivered envs.ready
        assert first == again and again.design_version == 2
        assert await store.observe_version(5) == 5
        assert await store.observe_version(4) == 5
        assert await store.observe_version(6) == 6
    finally:
        store.dispose()


async def test_a_slot_is_leased_to_one_worker_until_the_lease_expires(state_url: str) -> None:
    clock = _Clock()
    store = RolloutStateStore.from_url(state_url, clock=clock)
    try:
        await store.register(_env())
        first = await store.claim("w1", 10)
        assert first is not None and first.slot == 0  # the first plays are always due
        assert first.previous_owner is None  # a free slot
        assert await store.claim("w2", 10) is None  # leased
        (held,) = store.held_slots()  # the operator's view (spade cluster status)
        assert (held.owner, held.env_id, held.slot, held.expires_in_s, held.attempts) == ("w1", "e1", 0, 10, 1)
        clock.now += 11  # w1 died mid-play and stopped renewing
        assert [h.expires_in_s for h in store.held_slots()] == [-1]  # lapsed: anyone may take it over
        stolen = await store.claim("w2", 10)
        assert stolen is not None and (stolen.slot, stolen.attempts) == (0, 2)
        assert (stolen.previous_owner, stolen.previous_until) == ("w1", clock.now - 1)  # whose, and since when
        assert await store.lease("e1") == ("w2", clock.now + 10)
    finally:
        store.dispose()


async def test_a_worker_restarted_under_its_own_name_takes_its_lease_back_at_once(state_url: str) -> None:
    clock = _Clock()
    store = RolloutStateStore.from_url(state_url, clock=clock)
    try:
        await store.register(_env())
        assert await store.claim("w1", 600) is not None
        assert await store.claim("w1", 600, busy={"e1"}) is None  # still playing it: not claimed twice
        assert await store.claim("w2", 600) is None  # another worker waits for the lease
        resumed = await store.claim("w1", 600)  # w1 restarted: nothing in flight, its own lease
        assert resumed is not None and resumed.slot == 0 and resumed.previous_owner == "w1"
    finally:
        store.dispose()


async def test_a_live_worker_renews_its_lease_and_a_taken_over_one_learns_it_lost_it(state_url: str) -> None:
    clock = _Clock()
    store = RolloutStateStore.from_url(state_url, clock=clock)
    try:
        await store.register(_env())
        assert await store.claim("w1", 10) is not None
        clock.now += 8
        assert await store.extend("e1", "w1", 10)  # renewed: good until now + 10
        clock.now += 8
        assert await store.claim("w2", 10) is None
        clock.now += 3  # w1 stopped renewing
        assert await store.claim("w2", 10) is not None
        assert not await store.extend("e1", "w1", 10)  # the lease is w2's now
    finally:
        store.dispose()


async def test_the_databases_clock_times_leases_when_none_is_injected(state_url: str) -> None:
    store = RolloutStateStore.from_url(state_url)
    try:
        await store.register(_env())
        assert await store.claim("w1", 1.0) is not None
        assert await store.claim("w2", 1.0) is None
        for _ in range(100):  # one second of the database's clock
            await asyncio.sleep(0.05)
            claim = await store.claim("w2", 1.0)
            if claim is not None:
                break
        assert claim is not None and claim.attempts == 2
    finally:
        store.dispose()


async def test_slots_complete_in_order_and_the_window_closes_after_the_last(state_url: str) -> None:
    store = RolloutStateStore.from_url(state_url)
    try:
        await store.register(_env(window=2))
        await store.register(_env("one", window=1))
        await store.fix_window("e1", 4, 2)
        await store.fix_window("one", 4, 1)
        assert (await store.complete_slot("one", 0)).status is EnvStatus.CLOSED  # a window of one
        env = await store.complete_slot("e1", 0)
        assert (env.slots_done, env.status) == (1, EnvStatus.ACTIVE)
        assert (await store.complete_slot("e1", 0)).slots_done == 1  # finishing twice changes nothing
        assert (await store.complete_slot("e1", 1)).status is EnvStatus.CLOSED
        assert {e.env_id for e in await store.envs(EnvStatus.CLOSED)} == {"e1", "one"}
        await store.mark_play_done("e1@s0/plain/1", "e1", 0)
        await store.mark_retired("e1")
        assert await store.done_plays("e1", 0) == set()  # finished-play bookkeeping goes with the env
        assert [e.env_id for e in await store.envs(EnvStatus.RETIRED)] == ["e1"]
        assert await store.claim("w", 60) is None
    finally:
        store.dispose()


async def test_a_failed_slot_is_held_back_then_skipped_with_its_reason_recorded(state_url: str) -> None:
    clock = _Clock()
    store = RolloutStateStore.from_url(state_url, clock=clock)
    try:
        await store.register(_env(window=3))
        await store.fix_window("e1", 0, 3)
        await store.complete_slot("e1", 0)
        await store.observe_version(2)
        claim = await store.claim("w1", 10)
        assert claim is not None and claim.slot == 1
        await store.release("e1", "w1", error="SandboxFault: the jail died", hold_s=5)
        assert await store.claim("w2", 10) is None  # held back after a failure
        clock.now += 6
        again = await store.claim("w2", 10)
        assert again is not None and (again.slot, again.attempts, again.last_error) == (
            1,
            2,
            "SandboxFault: the jail died",
        )
        env = await store.skip_slot("e1", 1, "failed twice")
        assert env.slots_done == 2 and [(s.slot, s.reason) for s in await store.skipped("e1")] == [(1, "failed twice")]
        nxt = await store.claim("w2", 10)
        assert nxt is not None and (nxt.slot, nxt.attempts, nxt.last_error) == (2, 1, None)
        await store.release("e1", "w2")  # a stopping worker hands its slot over at once
        assert await store.claim("w3", 10) is not None
    finally:
        store.dispose()


async def test_a_claim_that_ended_in_an_outage_is_taken_back(state_url: str) -> None:
    clock = _Clock()
    store = RolloutStateStore.from_url(state_url, clock=clock)
    try:
        await store.register(_env(window=3))
        for _ in range(3):  # however long the outage, the slot's count of failed claims stays at 0
            claim = await store.claim("w1", 10)
            assert claim is not None and claim.attempts == 1
            await store.release("e1", "w1", error="MemoryUnavailable: down", hold_s=5, uncount=True)
            assert await store.claim("w2", 10) is None  # still held back, as after any failure
            clock.now += 6
        claim = await store.claim("w1", 10)
        assert claim is not None and (claim.attempts, claim.last_error) == (1, "MemoryUnavailable: down")
        await store.release("e1", "w1", error="ValueError: the env's fault", hold_s=5)
        clock.now += 6
        again = await store.claim("w1", 10)
        assert again is not None and again.attempts == 2  # an ordinary failure counts
    finally:
        store.dispose()


async def test_closing_an_unplayable_window_records_every_remaining_slot(state_url: str) -> None:
    store = RolloutStateStore.from_url(state_url)
    try:
        await store.register(_env(window=3))
        env = await store.close_unplayed("e1", "its first plays keep failing")
        assert env.status is EnvStatus.CLOSED
        assert [s.slot for s in await store.skipped("e1")] == [0, 1, 2]
        with pytest.raises(KeyError, match="register it first"):
            await store.complete_slot("nope", 0)
    finally:
        store.dispose()


async def test_workers_racing_for_one_slot_get_it_once(state_url: str) -> None:
    stores = [RolloutStateStore.from_url(state_url) for _ in range(2)]
    try:
        await stores[0].register(_env())
        claims = await asyncio.gather(*(s.claim(f"w{i}-{j}", 60) for i, s in enumerate(stores) for j in range(3)))
        assert sum(c is not None for c in claims) == 1
    finally:
        for s in stores:
            s.dispose()


@contextlib.contextmanager
def _forwarding(listener: socket.socket, target: tuple[str, int]) -> Iterator[None]:
    """Forward every connection accepted on ``listener`` to ``target`` (Postgres coming up on a port)."""
    stop = threading.Event()

    def pipe(a: socket.socket, b: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := a.recv(65536):
                b.sendall(data)
        with contextlib.suppress(OSError):
            b.shutdown(socket.SHUT_WR)

    def serve() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            upstream = socket.create_connection(target)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=pipe, args=(a, b), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(5)


async def test_a_worker_started_while_postgres_is_down_waits_for_it(
    postgres_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The store is opened as Postgres restarts (nothing answers on its port): it waits, then creates
    its tables once the server answers, instead of exiting."""
    upstream = urlsplit(postgres_url)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        url = postgres_url.replace(f"{upstream.hostname}:{upstream.port}", f"127.0.0.1:{port}")
        patient = RetryPolicy(attempts=200, initial_s=0.05, max_s=0.1, jitter_s=0.0)
        with caplog.at_level(logging.WARNING, logger="spade.rollout"):
            opening = asyncio.create_task(asyncio.to_thread(RolloutStateStore.from_url, url, wait=patient))
            while "creating the rollout's state tables failed" not in caplog.text:
                assert not opening.done(), opening  # it must wait for the database, not give up
                await asyncio.sleep(0.01)
            listener.listen()
            with _forwarding(listener, (str(upstream.hostname), int(upstream.port or 5432))):
                store = await opening
                try:
                    await store.register(_env())
                    assert (await store.get("e1")) is not None
                finally:
                    store.dispose()
