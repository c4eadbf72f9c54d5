"""A rollout worker: consumes ``envs.ready`` and ``weights.published``, plays window slots, publishes, records.

Several workers share one consumer group and one state store (horizontal scaling):

- ``envs.ready``: an env announced under this run's spec is registered in the active set (durable
  in the state store), then the message is acknowledged. Envs of another spec are refused with a
  logged reason.
- ``weights.published``: raises the latest weight version in the state store (all workers read it).
- slots: a worker leases an env's next due slot (short lease, renewed by a heartbeat while the plays
  run) and plays it. At the env's first play it fixes the env's window in the memory at its current
  version (first writer wins; everyone uses the stored answer). Slot 0 plays G seeds in both arms on
  the same seeds; slots ``1..k-1`` play fresh seeds without the hint, late if their version passed.
  Each play is published, recorded in the memory and marked done on its own, so a slot resumed after
  a crash, a takeover or SIGTERM plays only what is missing; then the slot is marked complete.
- audit plays (``core/audit.py``): at slot 0, alongside the real plays, each trivial policy (a
  constant and a random action) plays ``audit_plays`` of the slot's own seeds with no model call,
  each turn paced like a real turn (``core/pace.py``). No real play of slot 0 is kept (published,
  recorded, marked done) before the verdict: an env a trivial policy won too often has its real
  plays stopped and discarded, closes unplayed and retires as ``trivially_won``. The verdict is
  published on ``envs.audited`` (the learner waits for it) and kept in the state store. Audit plays
  are never published as samples nor recorded as plays.
- closed windows are reported to the memory (retried until it answers), then the env retires.
- a slot that fails is held back for ``lease_s`` and tried again; after ``max_attempts`` failed
  claims it is given up (poison work). A failure while a service the plays need was unreachable
  (an outage, not the env's doing) is not counted against the slot: see :func:`outage`.

Every step is idempotent by deterministic sample ids, so a re-run publishes and records nothing
twice. Every generation is seeded (``spade.inference.derive_sampling_seed``), so a re-run of a play
under the same weights samples the same tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Collection, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import redis.exceptions
import sqlalchemy.exc

from services.rollout.core.audit import (
    AuditPlay,
    AuditPlayer,
    AuditPolicy,
    AuditVerdict,
    audit_seeds,
    decide,
)
from services.rollout.core.ports import EnvNotFound, RolloutMemory
from services.rollout.core.schedule import ActiveEnv, EnvStatus, current_version, is_late
from services.rollout.core.seeds import play_seeds
from services.rollout.samples import (
    SlotRef,
    arm,
    audit_key,
    sample_id,
    to_agent_sample,
    to_env_audit,
    to_play_record,
)
from services.rollout.state_store import Claim, RolloutStateStore
from spade.agent.episode import EpisodeRunner, Play, TurnSeeds
from spade.agent.ports import EnvSpec
from spade.dependencies import Dependency
from spade.envs.types import Setting
from spade.errors import Unavailable
from spade.inference import derive_sampling_seed
from spade.memory.records import EnvStatus as MemoryEnvStatus
from spade.queues.base import ENVS_AUDITED, ENVS_READY, SAMPLES_AGENT, WEIGHTS_PUBLISHED, QueueFull, WorkQueue
from spade.queues.messages import decode, publish_proto
from spade.retry import RetryPolicy
from spade.runspec import RunSpec
from spade.sandbox.errors import SandboxFault
from spade.serving import lifecycle
from spade.serving.logs import get_logger, log_event
from spade.signal import group_has_signal
from spade.v1 import queues_pb2

log = get_logger(__name__)

_T = TypeVar("_T")

PLAY_RETRY = RetryPolicy(attempts=3, initial_s=0.0, max_s=0.0, jitter_s=0.0)
"""Default tries of a play after a sandbox fault (a service configures its own: ``RolloutSettings.retry``)."""


UNREACHABLE: tuple[type[BaseException], ...] = (
    Unavailable,
    ConnectionError,
    QueueFull,
    sqlalchemy.exc.OperationalError,
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
)
"""``spade.errors.Unavailable`` (which every client raises for an unreachable dependency: the inference
servers, the memory, a dependency waited for), then the failures of libraries the rollout calls
directly that say a store was unreachable or behind (the state store, the queue), never that the env
is bad. ``SandboxFault`` is not among them: an env can be the cause of one, so a sandbox fault counts
unless the sandbox is unreachable right after it."""


async def outage(exc: BaseException, dependencies: Sequence[Dependency] = ()) -> str | None:
    """What was unreachable when a slot failed with ``exc``, or None when the failure may be the env's.

    An outage is an ``UNREACHABLE`` error anywhere in the exception's chain, or one of
    ``dependencies`` not answering now (each probed once, together, within its own timeout).
    """
    seen: BaseException | None = exc
    for _ in range(8):  # the chain: the error, then what caused it
        if seen is None:
            break
        if isinstance(seen, UNREACHABLE):
            return f"{type(seen).__name__}: {seen}"[:300]
        seen = seen.__cause__ or seen.__context__
    if not dependencies:
        return None

    async def probe(dep: Dependency) -> str | None:
        try:
            await asyncio.to_thread(dep.check)
        except Exception as down:
            return str(down)[:300]
        return None

    down = [d for d in await asyncio.gather(*(probe(d) for d in dependencies)) if d]
    return down[0] if down else None


@dataclass(frozen=True)
class WorkerConfig:
    """How a worker schedules and publishes (see ``RolloutSettings`` for the documented fields).

    ``spec`` is the run spec: G, k per setting and the agent's budget come from it, and its id goes
    on every sample and play.
    """

    consumer: str
    spec: RunSpec = field(default_factory=RunSpec)
    group: str = "rollout"
    max_concurrent_plays: int = 8
    max_concurrent_envs: int = 4
    max_concurrent_audit_plays: int = 16
    audit_paced: bool = True
    play_retry: RetryPolicy = PLAY_RETRY
    max_attempts: int = 5
    lease_s: float = 15.0
    poll_s: float = 1.0
    block_ms: int = 1000
    shutdown_grace_s: float = 20.0
    publish_hinted: bool = True
    drop_mixed_versions: bool = False
    publish_timeout_s: float | None = None
    sampling_run: str | None = None
    zero_variance_extensions: int = 0

    @property
    def run_id(self) -> str:
        """The run identity sampling seeds are derived from (default: the spec id)."""
        return self.sampling_run or self.spec.spec_id


@dataclass
class WorkerCounts:
    """What this worker did (for tests and the service's log)."""

    plays: int = 0
    audit_plays: int = 0
    audited_envs: int = 0
    audit_retired: int = 0
    slots: int = 0
    late_slots: int = 0
    skipped_slots: int = 0
    extended_groups: int = 0
    refused_envs: int = 0
    lost_leases: int = 0
    released_on_stop: int = 0


class RolloutWorker:
    """One rollout worker.

    Args:
        queue: The work queues.
        store: The shared state store (active set, leases, finished plays).
        memory: Env code and hints in; windows, plays and retirements out.
        runner: Plays one env seed (its limits are the run spec's agent budget).
        config: Scheduling and publishing options, and the run spec.
        dependencies: The services the plays need (sandbox, inference, memory, state store, queue),
            probed when a slot fails: a failure while one is down is not counted against the slot.
    """

    def __init__(
        self,
        queue: WorkQueue,
        store: RolloutStateStore,
        memory: RolloutMemory,
        runner: EpisodeRunner,
        config: WorkerConfig,
        dependencies: Sequence[Dependency] = (),
    ) -> None:
        self.queue = queue
        self.store = store
        self._memory = memory
        self._runner = runner
        self.config = config
        self.dependencies = tuple(dependencies)
        self.counts = WorkerCounts()
        self._plays = asyncio.Semaphore(config.max_concurrent_plays)
        # Audit plays wait most of their time (paced like real turns) and call no model: their own
        # bound, so they never hold back the real plays whose turns set their pace.
        self._audit_plays = asyncio.Semaphore(config.max_concurrent_audit_plays)
        pace = runner.pace if config.audit_paced else None
        self._auditor = AuditPlayer(runner.sessions, runner.limits.max_turns, pace)
        self._jobs: dict[str, asyncio.Task[None]] = {}
        # Slots that left _jobs (see _schedule_once). A count, not a snapshot of the tasks in flight: a
        # slot that _fill itself started can end before _fill's last claim.
        self._jobs_ended = 0

    @property
    def spec(self) -> RunSpec:
        """The run spec this worker plays under."""
        return self.config.spec

    # ---- serving -----------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until ``stop`` is set, then stop within ``shutdown_grace_s`` (see :meth:`_shutdown`)."""
        try:
            await self._catch_up_weights(stop)
            await asyncio.gather(
                self._loop(stop, self.step_envs),
                self._loop(stop, self.step_weights),
                self._schedule(stop),
            )
        finally:
            await self._shutdown()

    async def _catch_up_weights(self, stop: asyncio.Event) -> None:
        """Take the weight announcements already published before any env is taken (as the embedded
        step does): a worker started after a publication must fix a new env's window at the current
        version, not at the env's design version. A failure here is left to the serving loop.
        """
        try:
            while not stop.is_set() and await self.step_weights():
                pass
        except Exception:
            log.exception("catching up on published weight versions failed; the serving loop retries")

    async def _loop(self, stop: asyncio.Event, step: Callable[[], Awaitable[int]]) -> None:
        while not stop.is_set():
            try:
                await step()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("rollout step %s failed; it will be retried", getattr(step, "__name__", step))
                await _sleep_or_stop(stop, self.config.poll_s)

    async def _schedule(self, stop: asyncio.Event) -> None:
        """Keep up to ``max_concurrent_envs`` slots in flight, each under its own lease."""
        while not stop.is_set():
            try:
                _, again = await self._schedule_once()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("scheduling slots failed; retrying in %.1fs", self.config.poll_s)
                again = False
            if again:
                continue
            waits: list[asyncio.Future[Any]] = [asyncio.ensure_future(stop.wait()), *self._jobs.values()]
            await asyncio.wait(waits, timeout=self.config.poll_s, return_when=asyncio.FIRST_COMPLETED)
            waits[0].cancel()

    async def _schedule_once(self, skip: Collection[str] = ()) -> tuple[int, bool]:
        """Retire closed windows and claim due slots (:meth:`_fill`); return the slots started and whether
        a slot ended meanwhile. A claim skips the envs in flight, so an env whose slot ended during it
        may have its next slot due: schedule again at once."""
        ended = self._jobs_ended
        await self._retire_closed()
        started = await self._fill(skip)
        return started, self._jobs_ended != ended

    async def _fill(self, skip: Collection[str] = ()) -> int:
        """Claim due slots (never of an env in flight or in ``skip``) until ``max_concurrent_envs`` are in
        flight or nothing is due; return how many were started."""
        started = 0
        while len(self._jobs) < self.config.max_concurrent_envs:
            claim = await self.store.claim(self.config.consumer, self.config.lease_s, {*self._jobs.keys(), *skip})
            if claim is None:
                break
            self._start(claim)
            started += 1
        return started

    def _start(self, claim: Claim) -> None:
        env_id = claim.env.env_id
        task = asyncio.create_task(self._run_claim(claim), name=f"slot {env_id}#{claim.slot}")
        self._jobs[env_id] = task
        task.add_done_callback(lambda _: self._end_job(env_id))

    def _end_job(self, env_id: str) -> None:
        self._jobs.pop(env_id, None)
        self._jobs_ended += 1

    async def _shutdown(self) -> None:
        """Let the slots in flight finish for ``shutdown_grace_s``, then cancel them (their leases are released).

        Finished plays are already published and recorded, so a cancelled slot resumes where it
        stopped, on whichever worker claims it next.
        """
        jobs = list(self._jobs.values())
        lifecycle.note_finished(slots_in_flight=len(jobs))
        if not jobs:
            return
        log_event(log, "rollout_stopping", in_flight=len(jobs), grace_s=self.config.shutdown_grace_s)
        _, pending = await asyncio.wait(jobs, timeout=self.config.shutdown_grace_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        self.counts.released_on_stop += len(pending)
        lifecycle.note_finished(slots_finished=len(jobs) - len(pending), slots_handed_back=len(pending))
        if pending:
            log_event(log, "rollout_stopped", level=logging.WARNING, cancelled_slots=len(pending))

    # ---- envs.ready --------------------------------------------------------------------------------

    async def step_envs(self) -> int:
        """Register announced envs (up to 16) in the active set; return how many messages were handled."""
        c = self.config
        deliveries = await self.queue.consume(ENVS_READY, c.group, c.consumer, count=16, block_ms=c.block_ms)
        for delivery in deliveries:
            msg = decode(delivery)
            assert isinstance(msg, queues_pb2.EnvReady)
            await self.register(msg)
            await self.queue.ack(delivery.stream, c.group, delivery.message_id)
        return len(deliveries)

    async def register(self, msg: queues_pb2.EnvReady) -> ActiveEnv | None:
        """Add an announced env to the active set (first registration wins); None when refused."""
        if msg.spec_id and msg.spec_id != self.spec.spec_id:
            self.counts.refused_envs += 1
            log_event(
                log,
                "env_refused",
                level=logging.ERROR,
                env_id=msg.env_id,
                reason="announced under another run spec",
                env_spec_id=msg.spec_id,
                spec_id=self.spec.spec_id,
            )
            return None
        try:
            stored = await self._memory.get_environment(msg.env_id)
        except EnvNotFound:
            log_event(log, "env_refused", level=logging.ERROR, env_id=msg.env_id, reason="the memory does not hold it")
            return None
        setting = Setting.parse(stored.setting)  # the memory's record; the message carries a copy
        env = await self.store.register(
            ActiveEnv(
                env_id=msg.env_id,
                setting=setting,
                skill=msg.skill or stored.skill,
                designer_sample_id=msg.designer_sample_id,
                window=msg.window_versions or self.spec.window_for(setting),
                design_version=msg.weight_version,
                spec_id=msg.spec_id or self.spec.spec_id,
            )
        )
        log_event(log, "env_registered", env_id=env.env_id, window=env.window, design_version=env.design_version)
        return env

    # ---- weights.published -------------------------------------------------------------------------

    async def step_weights(self) -> int:
        """Take weight announcements and raise the latest version in the store."""
        c = self.config
        group = f"{c.group}-weights"
        deliveries = await self.queue.consume(WEIGHTS_PUBLISHED, group, c.consumer, count=16, block_ms=c.block_ms)
        for delivery in deliveries:
            msg = decode(delivery)
            assert isinstance(msg, queues_pb2.WeightsPublished)
            if msg.spec_id and msg.spec_id != self.spec.spec_id:
                log_event(
                    log,
                    "weights_refused",
                    level=logging.ERROR,
                    weight_version=msg.weight_version,
                    reason="published under another run spec",
                    publisher_spec_id=msg.spec_id,
                    spec_id=self.spec.spec_id,
                )
            else:
                await self.store.observe_version(msg.weight_version)
            await self.queue.ack(delivery.stream, group, delivery.message_id)
        return len(deliveries)

    # ---- slots -------------------------------------------------------------------------------------

    async def step_window(self, skip: Collection[str] = ()) -> int:
        """Retire closed windows and play one due slot, if any (first plays included); return the work done.

        Args:
            skip: Envs whose due slots are left for later (the embedded run plays a chosen part of its
                pool each step); they stay due and are played late under their own slot index.
        """
        done = await self._retire_closed()
        claim = await self.store.claim(self.config.consumer, self.config.lease_s, {*self._jobs.keys(), *skip})
        if claim is None:
            return done
        await self._run_claim(claim)
        return done + 1 + await self._retire_closed()

    async def play_due(self, skip: Collection[str] = ()) -> int:
        """Play every due slot at once, up to ``max_concurrent_envs`` envs in flight; return the slots run.

        The embedded step's rollout: where :meth:`step_window` plays one slot and returns, this keeps
        claiming as slots finish (an env's next due slot, the envs beyond the bound) until nothing is
        due, so one env's plays never wait for another's. The plays share ``max_concurrent_plays``.
        Cancelled, it cancels the slots in flight (their leases are handed back, as :meth:`run`'s are).

        Args:
            skip: Envs whose due slots are left for later, as for :meth:`step_window`.
        """
        started = 0
        try:
            while True:
                started_now, again = await self._schedule_once(skip)
                started += started_now
                if again:
                    continue
                if not self._jobs:
                    return started
                await asyncio.wait(list(self._jobs.values()), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # cancelled, or the state store failed: no slot outlives the call
            jobs = list(self._jobs.values())
            for job in jobs:
                job.cancel()
            await asyncio.gather(*jobs, return_exceptions=True)
            raise

    def _say_whose(self, claim: Claim) -> None:
        """The lifecycle line of a claim that replaced a lease: another worker's (lapsed) or this one's own."""
        env_id = claim.env.env_id
        previous = claim.previous_owner
        if previous == self.config.consumer:
            lifecycle.resumed(
                f"resumed my own slot {claim.slot} of {env_id} (held before a restart)",
                env_id=env_id,
                slot=claim.slot,
                consumer=previous,
            )
        elif previous is not None:
            lifecycle.took_over(
                f"took over slot {claim.slot} of {env_id} from {previous}: its lease lapsed unrenewed",
                env_id=env_id,
                slot=claim.slot,
                from_owner=previous,
                reason="lease lapsed",
                lease_until=claim.previous_until,
                attempt=claim.attempts,
            )

    async def _run_claim(self, claim: Claim) -> None:
        """Play a claimed slot under its lease; on failure or cancellation hand the lease back."""
        env_id, owner = claim.env.env_id, self.config.consumer
        self._say_whose(claim)
        lost = asyncio.Event()
        work = asyncio.create_task(self._work(claim))
        beat = asyncio.create_task(self._keep_lease(env_id, work, lost))
        try:
            await work
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if lost.is_set() and (task is None or not task.cancelling()):
                return  # another worker holds the slot now: its plays carry the same ids
            with contextlib.suppress(Exception):
                await asyncio.shield(self.store.release(env_id, owner))
            log_event(log, "slot_released", env_id=env_id, slot=claim.slot, reason="stopping")
            raise
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"
            down = await outage(exc, self.dependencies)
            try:
                await self.store.release(env_id, owner, error=reason, hold_s=self.config.lease_s, uncount=bool(down))
            except Exception as lost_too:  # the state store is down as well: the lease lapses in lease_s
                log.warning("could not hand back the lease on %s (%s); it lapses by itself", env_id, lost_too)
            log_event(
                log,
                "slot_failed",
                level=logging.WARNING,
                env_id=env_id,
                slot=claim.slot,
                attempt=claim.attempts - bool(down),
                max_attempts=self.config.max_attempts,
                counted=not down,
                outage=down or "",
                retry_in_s=self.config.lease_s,
                error=reason[:300],
            )
        finally:
            beat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beat

    async def _keep_lease(self, env_id: str, work: asyncio.Task[None], lost: asyncio.Event) -> None:
        """Renew the lease every ``lease_s / 3`` while the plays run; stop them when it was taken over."""
        c = self.config
        while True:
            await asyncio.sleep(c.lease_s / 3)
            try:
                renewed = await self.store.extend(env_id, c.consumer, c.lease_s)
            except Exception as exc:  # a database hiccup: keep playing, try again next beat
                log.warning("could not renew the lease on %s (%s); trying again", env_id, exc)
                continue
            if not renewed:
                self.counts.lost_leases += 1
                log_event(log, "lease_lost", level=logging.WARNING, env_id=env_id, consumer=c.consumer)
                lost.set()
                work.cancel()
                return

    async def _work(self, claim: Claim) -> None:
        env, slot = claim.env, claim.slot
        if claim.attempts > self.config.max_attempts:
            await self._give_up(claim)
            return
        try:
            spec = await self._memory.get_environment(env.env_id)
        except EnvNotFound:
            await self.store.close_unplayed(env.env_id, "the memory no longer holds the env")
            log_event(
                log, "slot_skipped", level=logging.ERROR, env_id=env.env_id, slot=slot, reason="env not in the memory"
            )
            return
        if env.window_start is None:
            env = await self._fix_window(env)
        latest = await self.store.latest_version()
        ref = SlotRef(window_start=env.slot_version(0), window_index=slot, spec_id=self.spec.spec_id)
        late = is_late(env, slot, latest)
        if slot == 0:
            verdict = await self._audited_slot_0(env, spec, ref, late)
            if verdict is not None and verdict.trivially_won:
                await self.store.close_unplayed(
                    env.env_id, f"retired as {MemoryEnvStatus.TRIVIALLY_WON.value}: {verdict.reason}"
                )
                self.counts.audit_retired += 1
                log_event(
                    log,
                    "env_trivially_won",
                    level=logging.WARNING,
                    env_id=env.env_id,
                    designer_sample_id=env.designer_sample_id,
                    reason=verdict.reason,
                    spec_id=ref.spec_id,
                )
                return
        else:
            await self.play_slot(spec, ref, late=late)
        self.counts.late_slots += late
        await self.store.complete_slot(env.env_id, slot)
        self.counts.slots += 1
        log_event(
            log,
            "slot_done",
            env_id=env.env_id,
            window_start=ref.window_start,
            window_index=slot,
            version=ref.version,
            latest_version=latest,
            late=late,
            spec_id=ref.spec_id,
        )

    async def _fix_window(self, env: ActiveEnv) -> ActiveEnv:
        """At the env's first play: fix its window in the memory at the current version (first writer wins)."""
        asked = current_version(env.design_version, await self.store.latest_version())
        window = await self._memory.set_window(env.env_id, asked, env.window)
        fixed = await self.store.fix_window(env.env_id, window.start, window.versions)
        log_event(
            log,
            "window_fixed",
            env_id=env.env_id,
            window_start=window.start,
            window_versions=window.versions,
            asked_start=asked,
            design_version=env.design_version,
            spec_id=self.spec.spec_id,
        )
        return fixed

    async def _give_up(self, claim: Claim) -> None:
        """A slot whose plays failed on every claim: skip it (or, at slot 0, close the window) with the reason."""
        env, slot = claim.env, claim.slot
        reason = (
            f"its plays failed on {claim.attempts - 1} claims (max_attempts={self.config.max_attempts}); "
            f"last error: {claim.last_error or 'the worker playing it stopped'}"
        )
        if slot == 0:
            # Without first plays there is no regret and nothing to compare later slots to.
            await self.store.close_unplayed(env.env_id, reason)
        else:
            await self.store.skip_slot(env.env_id, slot, reason)
        self.counts.skipped_slots += 1
        log_event(log, "slot_skipped", level=logging.ERROR, env_id=env.env_id, slot=slot, reason=reason)

    async def _audited_slot_0(self, env: ActiveEnv, spec: EnvSpec, ref: SlotRef, late: bool) -> AuditVerdict | None:
        """Slot 0's real plays and the env's audit, side by side; no real play is kept before the verdict.

        The audit's turns are paced by the real plays' own (``core/pace.py``), so an audit lasts about
        as long as a play; side by side, the slot waits only for what the audit takes beyond its real
        plays (its noop plays use the whole turn budget). A ``trivially_won`` verdict stops the real
        plays and keeps none of them; a failure of either fails the slot (the other is stopped), as a
        failed play does.
        """
        audit = asyncio.create_task(self.audit(env, spec, ref))
        try:
            await self.play_slot(spec, ref, late=late, verdict=audit)
        except _TriviallyWon:
            pass
        finally:
            if not audit.done():  # the plays failed first
                audit.cancel()
            await asyncio.gather(audit, return_exceptions=True)
        return audit.result()

    async def audit(self, env: ActiveEnv, spec: EnvSpec, ref: SlotRef) -> AuditVerdict | None:
        """The env's audit verdict: played now at its first slot, or the one stored (None: no audit in this run).

        Each trivial policy plays the run spec's ``audit_plays`` first seeds of slot 0 (the real plays'
        own seeds). The verdict is kept in the state store first (first writer wins), then published on
        ``envs.audited`` (idempotent by env): whatever crash comes between, the learner and the rollout
        hold the same verdict, and a resumed slot 0 plays no audit twice and publishes the one it kept.
        """
        plays = self.spec.audit_plays
        if plays == 0:
            return None
        verdict = await self.store.audit(env.env_id)
        if verdict is None:
            seeds = audit_seeds(env.env_id, plays)
            done = await _all_or_none([self._audit_one(spec, seed, policy) for policy in AuditPolicy for seed in seeds])
            verdict = decide(env.env_id, done, self.spec.audit_max_win_rate)
            self.counts.audited_envs += 1
            log_event(
                log,
                "env_audited",
                env_id=env.env_id,
                trivially_won=verdict.trivially_won,
                win_rates={r.policy.value: round(r.win_rate, 3) for r in verdict.results},
                seeds=seeds,
                max_win_rate=verdict.max_win_rate,
                spec_id=ref.spec_id,
            )
            verdict = await self.store.record_audit(verdict)  # another worker's, if it stored one first
        message = to_env_audit(verdict, env.designer_sample_id, ref)
        c = self.config
        await publish_proto(self.queue, ENVS_AUDITED, message, key=audit_key(env.env_id), timeout_s=c.publish_timeout_s)
        return verdict

    async def _audit_one(self, spec: EnvSpec, seed: int, policy: AuditPolicy) -> AuditPlay:
        """One audit play, replayed from the start after a sandbox fault (no model, nothing published)."""
        what = f"auditing {spec.env_id} seed {seed} with the {policy} policy"
        play: AuditPlay | None = None
        async for attempt in self.config.play_retry.async_retrying(SandboxFault, logger=log, what=what):
            with attempt:
                async with self._audit_plays:
                    play = await self._auditor.play(spec, seed, policy)
        assert play is not None, "the retryer re-raises the last failure"
        self.counts.audit_plays += 1
        return play

    async def play_slot(
        self, spec: EnvSpec, ref: SlotRef, *, late: bool = False, verdict: Awaitable[AuditVerdict | None] | None = None
    ) -> list[Play]:
        """Play the missing plays of one slot: G seeds, both arms at slot 0 (same seeds), else unhinted.

        A group without signal is extended: when the unhinted returns of the slot are all equal
        (``spade.signal.group_has_signal``: nothing the learner could train on), G fresh seeds of the
        same slot are played, in both arms at slot 0 so the regret's arms keep identical seeds, up to
        ``zero_variance_extensions`` times. The seeds are the slot's seed list continued
        (``play_seeds`` is prefix-stable), so every worker and restart extends with the same seeds.
        The decision is taken on the plays this call played: a slot resumed after an interruption,
        whose earlier plays are done, decides on what it plays itself.

        With ``verdict`` (slot 0's audit, running alongside), each play is kept once the audit has
        passed it (as soon as it ends, once the verdict is in), and the slot goes on meanwhile: a group
        is extended on its plays' returns without waiting for the verdict. A ``trivially_won`` verdict
        stops the plays still running and raises ``_TriviallyWon``; no play is kept.
        """
        judged = None if verdict is None else asyncio.ensure_future(verdict)
        keeping: list[asyncio.Task[None]] = []

        async def keep(play: Play) -> None:
            if judged is None:
                await self._kept(play, spec, ref, late)
            else:
                keeping.append(asyncio.create_task(self._kept_once_passed(judged, play, spec, ref, late)))

        playing = asyncio.create_task(self._slot_plays(spec, ref, keep))
        try:
            if judged is not None:
                await asyncio.wait({playing, judged}, return_when=asyncio.FIRST_COMPLETED)
                if judged.done():
                    _raise_if_trivially_won(judged.result())  # stops the plays still running
            plays = await playing
            await asyncio.gather(*keeping)
        except BaseException:
            for task in (playing, *keeping):
                task.cancel()
            await asyncio.gather(playing, *keeping, return_exceptions=True)
            raise
        return plays

    async def _slot_plays(self, spec: EnvSpec, ref: SlotRef, keep: Callable[[Play], Awaitable[None]]) -> list[Play]:
        """The slot's first group and its extensions (see :meth:`play_slot`), ``keep`` called on each play."""
        group = self.spec.group_size
        seeds = play_seeds(spec.env_id, ref.window_index, group)
        plays = await self._play_seeds(spec, ref, seeds, keep)
        for extension in range(1, self.config.zero_variance_extensions + 1):
            returns = [p.episode_return for p in plays if not p.hinted and not p.finish_reason.is_resource_fault]
            if len(returns) < 2 or group_has_signal(returns):
                break
            seeds = play_seeds(spec.env_id, ref.window_index, group * (extension + 1))[group * extension :]
            self.counts.extended_groups += 1
            log_event(
                log,
                "group_extended",
                env_id=spec.env_id,
                window_index=ref.window_index,
                version=ref.version,
                extension=extension,
                returns=sorted(set(returns)),
                fresh_seeds=len(seeds),
            )
            plays += await self._play_seeds(spec, ref, seeds, keep)
        return plays

    async def _play_seeds(
        self, spec: EnvSpec, ref: SlotRef, seeds: Sequence[int], keep: Callable[[Play], Awaitable[None]]
    ) -> list[Play]:
        """Play ``seeds`` of one slot (both arms at slot 0), skipping plays already done; ``keep`` each
        play as it ends.

        Hinted and unhinted plays of a seed start together so their shared prompt prefix is
        prefilled once (the inference server's radix cache).
        """
        arms = (False, True) if ref.window_index == 0 else (False,)
        done = await self.store.done_plays(spec.env_id, ref.window_index)
        todo = [
            (seed, hinted)
            for seed in seeds
            for hinted in arms
            if sample_id(spec.env_id, ref.window_index, seed, hinted=hinted) not in done
        ]

        async def one(seed: int, hinted: bool) -> Play:
            play = await self._play_one(spec, ref, seed, hinted)
            await keep(play)
            return play

        return await _all_or_none([one(seed, hinted) for seed, hinted in todo])

    def turn_seeds(self, env_id: str, ref: SlotRef, seed: int, hinted: bool) -> TurnSeeds:
        """The ``sampling_seed`` of each turn of one play: (run, env, slot version, seed, arm, turn)."""
        run, version, name = self.config.run_id, ref.version, arm(hinted)
        return lambda turn: derive_sampling_seed(run, env_id, version, seed, name, turn)

    async def _play_one(self, spec: EnvSpec, ref: SlotRef, seed: int, hinted: bool) -> Play:
        """One play, replayed from the start after a sandbox fault (not yet kept)."""
        what = f"playing {spec.env_id} seed {seed}"
        seeds = self.turn_seeds(spec.env_id, ref, seed, hinted)
        play: Play | None = None
        async for attempt in self.config.play_retry.async_retrying(SandboxFault, logger=log, what=what):
            with attempt:
                async with self._plays:  # not held while backing off
                    play = await self._runner.play(spec, seed, hinted=hinted, turn_seeds=seeds)
        assert play is not None, "the retryer re-raises the last failure"
        return play

    async def _kept_once_passed(
        self, judged: asyncio.Future[AuditVerdict | None], play: Play, spec: EnvSpec, ref: SlotRef, late: bool
    ) -> None:
        """Keep ``play`` once its env's audit has passed it.

        Raises:
            _TriviallyWon: The audit retired the env; the play is not kept.
        """
        _raise_if_trivially_won(await judged)
        await self._kept(play, spec, ref, late)

    async def _kept(self, play: Play, spec: EnvSpec, ref: SlotRef, late: bool) -> None:
        """Keep one play (:meth:`_keep`: published, recorded, marked done), counted and logged."""
        await self._keep(play, spec, ref)
        self.counts.plays += 1
        log_event(
            log,
            "play",
            env_id=spec.env_id,
            version=ref.version,
            weight_version=play.trajectory.oldest_version,
            window_start=ref.window_start,
            window_index=ref.window_index,
            arm=arm(play.hinted),
            seed=play.seed,
            episode_return=play.episode_return,
            turns=play.turns,
            finish_reason=play.finish_reason.value,
            turn_cap=play.turn_cap,
            turn_budget=self._runner.limits.max_turns,
            late=late,
            spec_id=ref.spec_id,
        )

    async def _keep(self, play: Play, spec: EnvSpec, ref: SlotRef) -> None:
        """Publish, record and mark done, in that order (each step idempotent)."""
        c = self.config
        sid = sample_id(spec.env_id, ref.window_index, play.seed, hinted=play.hinted)
        if self._trainable(play, spec):
            sample = to_agent_sample(play, spec, ref)
            await publish_proto(self.queue, SAMPLES_AGENT, sample, key=sid, timeout_s=c.publish_timeout_s)
        await self._memory.record_plays(spec.env_id, [to_play_record(play, ref)])
        if play.trajectory.weight_versions:
            await self.store.observe_version(max(play.trajectory.weight_versions))
        await self.store.mark_play_done(sid, spec.env_id, ref.window_index)

    def _trainable(self, play: Play, spec: EnvSpec) -> bool:
        if not play.trajectory.model_tokens:
            return False  # nothing to train on (the env failed at reset); still recorded
        if play.hinted and not self.config.publish_hinted:
            return False
        if play.trajectory.mixed_versions and self.config.drop_mixed_versions:
            log.info("not publishing %s seed %d: its turns span weight versions", spec.env_id, play.seed)
            return False
        return True

    async def _retire_closed(self) -> int:
        closed = await self.store.envs(EnvStatus.CLOSED)
        for env in closed:
            last = env.slot_version(env.window - 1) if env.window_start is not None else env.design_version
            verdict = await self.store.audit(env.env_id)
            trivial = verdict is not None and verdict.trivially_won
            await self._memory.retire_environment(env.env_id, last, trivially_won=trivial)
            await self.store.mark_retired(env.env_id)
            skipped = await self.store.skipped(env.env_id)
            log_event(
                log,
                "env_retired",
                env_id=env.env_id,
                last_version=last,
                retired_as=MemoryEnvStatus.TRIVIALLY_WON.value if trivial else "window_closed",
                skipped_slots=[s.slot for s in skipped],
            )
        return len(closed)


class _TriviallyWon(Exception):
    """Slot 0's audit retired the env while its real plays ran: they stop and none is kept."""

    def __init__(self, verdict: AuditVerdict) -> None:
        super().__init__(verdict.reason)
        self.verdict = verdict


def _raise_if_trivially_won(verdict: AuditVerdict | None) -> None:
    if verdict is not None and verdict.trivially_won:
        raise _TriviallyWon(verdict)


async def _all_or_none(work: Sequence[Coroutine[Any, Any, _T]]) -> list[_T]:
    """Run ``work`` concurrently; one failure fails them all: its siblings are stopped, not left running."""
    tasks = [asyncio.create_task(w) for w in work]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _sleep_or_stop(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), timeout=seconds)
