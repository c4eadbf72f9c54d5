"""A rollout worker: consumes ``envs.ready`` and ``weights.published``, plays, publishes, records.

Several workers share one consumer group and one state store (horizontal scaling):

- ``envs.ready``: each env goes to one worker, which registers it in the active set and plays its
  first version — G seeds without and with the hint, the same seeds in both arms. The message is
  acknowledged only after every sample is published, the plays are recorded in the memory and the
  progress is stored; a worker killed mid-play leaves it pending and the queue re-delivers it.
- ``weights.published``: raises the latest weight version in the state store (all workers read it).
- window plays: a worker leases an env whose next version in its window is due, plays G fresh seeds
  without the hint, publishes, records and stores the progress; a dead worker's lease expires.
- closed windows are reported to the memory (retried until it answers), then the env retires.

Every step is idempotent by deterministic sample ids, so a re-run after a crash publishes and
records nothing twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from services.rollout.core.episode import EpisodeRunner, Play
from services.rollout.core.ports import EnvSource, EnvSpec, PlayLog
from services.rollout.core.schedule import ActiveEnv
from services.rollout.core.seeds import play_seeds
from services.rollout.samples import to_agent_sample, to_play_record
from services.rollout.state_store import RolloutStateStore
from spade.queues.base import ENVS_READY, SAMPLES_AGENT, WEIGHTS_PUBLISHED, Delivery, WorkQueue
from spade.queues.messages import decode, publish_proto
from spade.retry import RetryPolicy
from spade.sandbox.errors import SandboxFault
from spade.v1 import queues_pb2

log = logging.getLogger(__name__)

PLAY_RETRY = RetryPolicy(attempts=3, initial_s=0.0, max_s=0.0, jitter_s=0.0)
"""Default tries of a play after a sandbox fault (a service configures its own: ``RolloutSettings.retry``)."""


class EnvNotFound(LookupError):
    """The memory has no env with the id ``envs.ready`` named (raised by ``EnvSource`` adapters)."""


@dataclass(frozen=True)
class WorkerConfig:
    """How a worker schedules and publishes (see ``RolloutSettings`` for the documented fields)."""

    consumer: str
    group: str = "rollout"
    group_size: int = 8
    window: int = 4
    max_concurrent_plays: int = 8
    play_retry: RetryPolicy = PLAY_RETRY
    max_deliveries: int = 5
    lease_s: float = 600.0
    poll_s: float = 1.0
    block_ms: int = 1000
    publish_hinted: bool = True
    drop_mixed_versions: bool = False
    publish_timeout_s: float | None = None


class RolloutWorker:
    """One rollout worker.

    Args:
        queue: The work queues.
        store: The shared active-set store.
        envs: Reads env code and hints from the memory.
        plays_log: Records plays and retirements in the memory.
        runner: Plays one env seed.
        config: Scheduling and publishing options.
    """

    def __init__(
        self,
        queue: WorkQueue,
        store: RolloutStateStore,
        envs: EnvSource,
        plays_log: PlayLog,
        runner: EpisodeRunner,
        config: WorkerConfig,
    ) -> None:
        self.queue = queue
        self.store = store
        self._envs = envs
        self._log = plays_log
        self._runner = runner
        self.config = config
        self._plays = asyncio.Semaphore(config.max_concurrent_plays)

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until ``stop`` is set (each loop finishes its current item first)."""
        await asyncio.gather(
            self._loop(stop, self.step_envs),
            self._loop(stop, self.step_weights),
            self._loop(stop, self.step_window, idle_s=self.config.poll_s),
        )

    async def _loop(self, stop: asyncio.Event, step: Callable[[], Awaitable[int]], idle_s: float = 0.0) -> None:
        while not stop.is_set():
            try:
                did = await step()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("rollout step %s failed; it will be retried", getattr(step, "__name__", step))
                did = 0
                await _sleep_or_stop(stop, self.config.poll_s)
            if not did and idle_s:
                await _sleep_or_stop(stop, idle_s)

    # ---- envs.ready -------------------------------------------------------------------------------

    async def step_envs(self) -> int:
        """Take one env from ``envs.ready`` and play its first version; return how many were handled."""
        c = self.config
        deliveries = await self.queue.consume(ENVS_READY, c.group, c.consumer, count=1, block_ms=c.block_ms)
        for delivery in deliveries:
            await self.handle_env_ready(delivery)
        return len(deliveries)

    async def handle_env_ready(self, delivery: Delivery) -> None:
        """Register the env and play its first version; ack once everything is durable."""
        msg = decode(delivery)
        assert isinstance(msg, queues_pb2.EnvReady)
        try:
            spec = await self._envs.get_environment(msg.env_id)
        except EnvNotFound:
            log.error("envs.ready named env %r, which the memory does not hold; dropping the message", msg.env_id)
            await self.queue.ack(delivery.stream, self.config.group, delivery.message_id)
            return
        env = await self.store.register(
            ActiveEnv(
                env_id=msg.env_id,
                setting=msg.setting or spec.setting,
                skill=msg.skill or spec.skill,
                designer_sample_id=msg.designer_sample_id,
                first_version=msg.weight_version,
                window=msg.window_versions or self.config.window,
            )
        )
        if env.played_through is None and delivery.deliveries > self.config.max_deliveries:
            # Poison work (an env that keeps crashing the sandbox, say) must not circle forever.
            log.error(
                "env %s failed its first plays on %d deliveries (max_deliveries=%d); closing its window unplayed",
                env.env_id,
                delivery.deliveries - 1,
                self.config.max_deliveries,
            )
            await self.store.abandon(env.env_id)
        elif env.played_through is None:
            plays = await self.play_version(spec, env.first_version, with_hint=True)
            await self._finish(spec, env.first_version, plays)
        await self.queue.ack(delivery.stream, self.config.group, delivery.message_id)

    # ---- weights.published ------------------------------------------------------------------------

    async def step_weights(self) -> int:
        """Take weight announcements and raise the latest version in the store."""
        c = self.config
        deliveries = await self.queue.consume(
            WEIGHTS_PUBLISHED, f"{c.group}-weights", c.consumer, count=16, block_ms=c.block_ms
        )
        for delivery in deliveries:
            msg = decode(delivery)
            assert isinstance(msg, queues_pb2.WeightsPublished)
            await self.store.observe_version(msg.weight_version)
            await self.queue.ack(delivery.stream, f"{c.group}-weights", delivery.message_id)
        return len(deliveries)

    # ---- window plays and retirement --------------------------------------------------------------

    async def step_window(self) -> int:
        """Play one due window version (if any) and retire closed windows; return the work done."""
        done = await self._retire_closed()
        claim = await self.store.claim_due(self.config.consumer, self.config.lease_s)
        if claim is None:
            return done
        env, version = claim
        renewal = asyncio.create_task(self._keep_lease(env.env_id))
        try:
            spec = await self._envs.get_environment(env.env_id)
            plays = await self.play_version(spec, version, with_hint=False)
            await self._finish(spec, version, plays)
        except BaseException:
            await self.store.release(env.env_id, self.config.consumer)
            raise
        finally:
            renewal.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewal
        return done + 1 + await self._retire_closed()

    async def _keep_lease(self, env_id: str) -> None:
        """Renew the lease while the plays run, so only a dead worker loses it."""
        c = self.config
        while True:
            await asyncio.sleep(c.lease_s / 3)
            if not await self.store.extend(env_id, c.consumer, c.lease_s):
                log.warning("lost the lease on %s; another worker may play it too (samples stay idempotent)", env_id)
                return

    async def _retire_closed(self) -> int:
        closed = await self.store.close_passed_windows()
        for env in closed:
            await self._log.retire_environment(env.env_id, env.played_through or env.first_version)
            await self.store.mark_retired(env.env_id)
        return len(closed)

    # ---- playing ----------------------------------------------------------------------------------

    async def play_version(self, spec: EnvSpec, version: int, *, with_hint: bool) -> list[Play]:
        """Play G seeds of ``spec`` for ``version``: unhinted, and if ``with_hint`` hinted on the same seeds."""
        seeds = play_seeds(spec.env_id, version, self.config.group_size)
        arms = [False, True] if with_hint else [False]
        tasks = [asyncio.create_task(self._play(spec, seed, hinted)) for hinted in arms for seed in seeds]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            # One failed play fails the version: stop its siblings instead of leaving them running.
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def _play(self, spec: EnvSpec, seed: int, hinted: bool) -> Play:
        """One play, replayed from the start after a sandbox fault (the env's state died with it)."""
        what = f"playing {spec.env_id} seed {seed}"
        async for attempt in self.config.play_retry.async_retrying(SandboxFault, logger=log, what=what):
            with attempt:
                async with self._plays:  # not held while backing off
                    return await self._runner.play(spec, seed, hinted=hinted)
        raise AssertionError("unreachable: the retryer re-raises the last failure")

    async def _finish(self, spec: EnvSpec, version: int, plays: Sequence[Play]) -> None:
        """Publish, record and store progress, in that order (each step idempotent)."""
        c = self.config
        for play in plays:
            if not play.trajectory.model_tokens:
                continue  # nothing to train on (the env failed at reset); still recorded below
            if play.hinted and not c.publish_hinted:
                continue
            if play.trajectory.mixed_versions and c.drop_mixed_versions:
                log.info("dropping %s seed %d: its turns span weight versions", spec.env_id, play.seed)
                continue
            sample = to_agent_sample(play, spec, version)
            await publish_proto(self.queue, SAMPLES_AGENT, sample, key=sample.sample_id, timeout_s=c.publish_timeout_s)
        await self._log.record_plays(spec.env_id, [to_play_record(p, version) for p in plays])
        seen = [v for p in plays for v in p.trajectory.weight_versions]
        if seen:
            await self.store.observe_version(max(seen))
        await self.store.complete(spec.env_id, version)


async def _sleep_or_stop(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), timeout=seconds)
