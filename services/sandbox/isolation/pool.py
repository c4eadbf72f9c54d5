"""``SandboxPool``: execute, validate and play untrusted code in isolated, pre-forked jails.

Every request gets its own process tree from a pre-warmed zygote (see ``runtime/zygote.py``) and its
own channels, which the service creates and hands over; the zygote never proxies data. The service
enforces what the untrusted side could lie about: wall-clock limits, output caps, frame sizes.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import itertools
import math
import os
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from services.sandbox.isolation import layers as layers_mod
from services.sandbox.isolation.cgroups import CgroupLimits, CgroupPlan, make_cgroup, remove_cgroup
from services.sandbox.isolation.channels import Channel
from services.sandbox.isolation.execution import run_execution
from services.sandbox.isolation.outcomes import ExecLimits, ExecStatus, ExecutionResult, SandboxFault
from services.sandbox.isolation.repairs import Repairs
from services.sandbox.isolation.session import SandboxSession, ended_outcome
from services.sandbox.isolation.settings import IsolationSettings
from services.sandbox.isolation.staging import remove_staging, stage_sources
from services.sandbox.isolation.validation import validate_in_sessions
from services.sandbox.isolation.zygote import Spawned, Zygote, ZygotePlan
from spade.envs.types import CheckConfig, Outcome, ValidationReport
from spade.retry import RetryPolicy
from spade.serving.logs import get_logger

log = get_logger(__name__)

EXIT_GRACE_S = 5.0
"""How long the pool waits for the zygote to confirm a request's processes are gone."""
REAP_RETRY = RetryPolicy(attempts=2, initial_s=0.0, max_s=0.0, jitter_s=0.0)
"""Kills sent to a request that outlives its grace, at once, before its zygote is given up as stuck."""
CANARY = (
    "import os, sys\n"
    "fields = dict(line.split(':', 1) for line in open('/proc/self/status') if ':' in line)\n"
    "print(sys.stdin.read(), os.getuid(), *(fields[k].strip() for k in ('Seccomp', 'NoNewPrivs', 'CapEff')))\n"
)
"""Run at start: proves the chain works and that the layers the plan uses are really in place."""


@dataclass
class _Slot:
    zygote: Zygote | None
    restarts: int = 0


class SandboxPool:
    """Pre-warmed zygotes and the three kinds of request they serve.

    Args:
        settings: isolation layers, identity and limits.

    Use ``await pool.start()`` before any request and ``await pool.stop()`` at the end (or
    ``async with SandboxPool(settings) as pool``).
    """

    def __init__(self, settings: IsolationSettings | None = None) -> None:
        self.settings = settings or IsolationSettings()
        self.layers: dict[str, layers_mod.LayerStatus] = {}
        self.degraded: list[str] = []
        self._slots: list[_Slot] = []
        self._plan: ZygotePlan | None = None
        self._next = itertools.count()
        self._concurrency = asyncio.Semaphore(self.settings.max_concurrency)
        self._restart_lock = asyncio.Lock()
        self._sessions: set[SandboxSession] = set()
        self._reaping: set[asyncio.Task[None]] = set()
        self._watchers: set[asyncio.Task[None]] = set()
        self._stopping = False
        self.repairs = Repairs()
        self.cgroup = CgroupPlan(None, detail="not started")
        self.faults = 0

    async def __aenter__(self) -> SandboxPool:
        await self.start()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.stop()

    # -- life cycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        """Probe the layers, stage the sources, launch the zygotes and run one canary execution.

        Raises:
            SandboxUnavailable: a layer is missing and ``allow_degraded`` does not name it.
            SandboxFault: the zygote could not start, or the canary did not echo its input.
        """
        if self._plan is not None:
            raise RuntimeError("this SandboxPool is already started: stop() it before starting it again")
        self.layers = await asyncio.to_thread(layers_mod.probe_layers, self.settings)
        self.degraded = layers_mod.require_layers(self.settings, self.layers)
        ok = {name: status.available for name, status in self.layers.items()}
        staging = await asyncio.to_thread(stage_sources)
        try:
            self.cgroup = await asyncio.to_thread(self._make_cgroup, staging.name)
        except BaseException:
            await asyncio.to_thread(remove_staging, staging)
            raise
        (log.warning if self.cgroup.version is None else log.info)(
            "sandbox limits across jails: %s", self.cgroup.detail
        )
        self._plan = ZygotePlan(
            settings=self.settings,
            staging=staging,
            use_setpriv=ok["setpriv"],
            use_bwrap=ok["bwrap"],
            use_userns=ok["userns"],
            use_seccomp=ok["seccomp"],
            cgroup=self.cgroup,
        )
        if self.degraded:
            log.warning("sandbox running DEGRADED, without: %s", ", ".join(self.degraded))
        try:
            self._stopping = False
            self._slots = [_Slot(await Zygote.launch(self._plan)) for _ in range(self.settings.zygotes)]
            for slot in self._slots:
                assert slot.zygote is not None
                self._watch(slot.zygote)
            await self._check_canary(self._plan)
        except BaseException:
            await self.stop()
            raise

    def _make_cgroup(self, name: str) -> CgroupPlan:
        s = self.settings
        if s.cgroup == "off":
            return CgroupPlan(None, detail="no cgroup (isolation.cgroup=off): per-jail rlimits only")
        limits = CgroupLimits(s.total_memory_mb << 20, s.total_processes, s.cpu_weight)
        return make_cgroup(name, limits, required=s.cgroup == "required")

    async def _check_canary(self, plan: ZygotePlan) -> None:
        """Run one program and compare what it sees of itself with what the plan promises."""
        for slot in self._slots:
            assert slot.zygote is not None
            seccomp = slot.zygote.ready.get("layers", {}).get("seccomp", {})
            if plan.use_seccomp and not seccomp.get("ok"):
                raise layers_mod.SandboxUnavailable(
                    {"seccomp": layers_mod.LayerStatus(False, f"the zygote could not build the filter: {seccomp}")}
                )
        result = await self.execute(CANARY, stdin=b"canary")
        uid = self.settings.uid if (plan.use_userns or plan.use_setpriv) else os.geteuid()
        expected = f"canary {uid} {2 if plan.use_seccomp else 0} 1 {0:016x}\n".encode()
        if result.status is not ExecStatus.OK or result.stdout != expected:
            raise SandboxFault(
                f"the canary execution did not see the promised isolation: expected {expected!r}, got "
                f"{result.status.value} {result.stdout[:200]!r} {result.stderr[-300:].decode('utf-8', 'replace')}"
            )

    async def stop(self) -> None:
        """Close every session, stop the zygotes (killing whatever still runs), remove the staging."""
        self._stopping = True
        for watcher in list(self._watchers):
            watcher.cancel()
        await asyncio.gather(*self._watchers, return_exceptions=True)
        for session in list(self._sessions):
            await session.close()
        if self._reaping:
            await asyncio.gather(*self._reaping, return_exceptions=True)
        async with self._restart_lock:
            for slot in self._slots:
                if slot.zygote is not None:
                    await slot.zygote.close()
            self._slots = []
        if self._plan is not None:
            await asyncio.to_thread(remove_cgroup, self._plan.cgroup)
            await asyncio.to_thread(remove_staging, self._plan.staging)
            self._plan = None

    @property
    def instance(self) -> str | None:
        """A name unique to this started pool; it appears on every one of its processes' command line."""
        return self._plan.staging.name if self._plan else None

    def health(self) -> dict[str, Any]:
        """Layers (and which run degraded), zygotes, and what is in flight."""
        zygotes = [
            {
                "pid": slot.zygote.process.pid if slot.zygote else None,
                "alive": bool(slot.zygote and slot.zygote.alive),
                "in_flight": slot.zygote.in_flight if slot.zygote else 0,
                "restarts": slot.restarts,
            }
            for slot in self._slots
        ]
        alive = any(z["alive"] for z in zygotes)
        status = "down" if not alive else ("degraded" if self.degraded else "ok")
        envs = {}
        for slot in self._slots:
            if slot.zygote is not None:
                envs = slot.zygote.ready.get("layers", {}).get("envs", {})
                break
        return {
            "status": status,
            "degraded": list(self.degraded),
            "layers": {name: s.to_dict() for name, s in self.layers.items()},
            "envs_library": envs,
            "zygotes": zygotes,
            "sessions": len(self._sessions),
            "faults": self.faults,
            "cgroup": self.cgroup.to_dict(),
        }

    async def _zygote(self) -> Zygote:
        if not self._slots or self._plan is None:
            raise SandboxFault("the sandbox pool is not started: call start() first")
        for _ in range(len(self._slots)):
            slot = self._slots[next(self._next) % len(self._slots)]
            if slot.zygote is not None and slot.zygote.alive:
                return slot.zygote
        await self._restart_dead()
        zygote = self._slots[0].zygote if self._slots else None
        if zygote is None or not zygote.alive:
            raise SandboxFault("no zygote is running and none could be restarted")
        return zygote

    async def _restart_dead(self) -> None:
        async with self._restart_lock:
            for slot in self._slots:
                if self._plan is None or self._stopping or (slot.zygote is not None and slot.zygote.alive):
                    continue
                if slot.zygote is not None:
                    await slot.zygote.close(timeout_s=1.0)
                slot.zygote = None
                slot.restarts += 1
                log.warning("restarting a dead zygote (restart %d)", slot.restarts)
                slot.zygote = await Zygote.launch(self._plan)
                self._watch(slot.zygote)

    def _watch(self, zygote: Zygote) -> None:
        """Restart ``zygote`` as soon as it dies (not only when the next request needs it)."""

        async def watch() -> None:
            await zygote.died.wait()
            if self._plan is not None and not self._stopping:
                try:
                    await self._restart_dead()
                except SandboxFault as exc:
                    log.error("could not restart a zygote: %s (the next request will retry)", exc)

        task = asyncio.create_task(watch())
        self._watchers.add(task)
        task.add_done_callback(self._watchers.discard)

    def _limits(self, *, cpu_s: float, memory_mb: int) -> dict[str, int]:
        s = self.settings
        return {
            "cpu_seconds": max(1, math.ceil(cpu_s)),
            "memory_bytes": memory_mb << 20,
            "processes": s.processes,
            "open_files": s.open_files,
            "file_size_bytes": s.file_size_mb << 20,
        }

    @contextlib.asynccontextmanager
    async def _jail(
        self, kind: str, limits: dict[str, int], extra_fds: list[int]
    ) -> AsyncIterator[tuple[Spawned, Zygote, Channel]]:
        """Spawn one jailed process; on exit make sure it (and its whole pid namespace) is gone."""
        try:
            zygote = await self._zygote()
            parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                spawned = await zygote.spawn(kind, limits, [child.fileno(), *extra_fds])
            except BaseException:
                parent.close()
                raise
            finally:
                child.close()
        finally:
            for fd in extra_fds:
                os.close(fd)
        channel = await Channel.open(parent)
        try:
            yield spawned, zygote, channel
        finally:
            channel.close()
            if not spawned.exited.done():
                # Off the request's critical path: the namespace's teardown takes a few ms.
                task = asyncio.create_task(self._reap(zygote, spawned))
                self._reaping.add(task)
                task.add_done_callback(self._reaping.discard)

    async def _reap(self, zygote: Zygote, spawned: Spawned) -> None:
        """Kill the request's processes and wait until the zygote confirms they are gone."""
        what = f"killing request {spawned.request_id} (confirmed within {EXIT_GRACE_S:g} s)"
        try:
            async for attempt in REAP_RETRY.async_retrying(TimeoutError, logger=log, what=what):
                with attempt:
                    await zygote.kill(spawned)
                    async with asyncio.timeout(EXIT_GRACE_S):
                        await asyncio.shield(spawned.exited)
        except SandboxFault:
            pass  # the zygote died: its children died with it
        except TimeoutError:
            self.faults += 1
            log.error("zygote did not confirm the end of request %d; restarting it", spawned.request_id)
            await zygote.close(timeout_s=1.0)

    # -- execute -------------------------------------------------------------------------------
    async def execute(
        self,
        code: str,
        stdin: bytes = b"",
        files: dict[str, bytes] | None = None,
        limits: ExecLimits | None = None,
        *,
        timeout_s: float | None = None,
        memory_mb: int | None = None,
    ) -> ExecutionResult:
        """Run a Python program as ``__main__`` in a fresh jail.

        Args:
            code: the program's source.
            stdin: bytes fed to its standard input.
            files: relative path → content, written into its private working directory first.
            limits: wall-clock/memory/CPU limits (``None`` fields: service defaults);
                ``timeout_s``/``memory_mb`` are shorthands that override ``limits``.

        Returns:
            status, exit code, capped stdout/stderr and duration.

        Raises:
            ValueError: a limit above the configured maximum.
            SandboxFault: the sandbox failed (not the program).
        """
        limits = limits or ExecLimits()
        s = self.settings
        wall = timeout_s or limits.timeout_s or s.wall_seconds
        memory = memory_mb or limits.memory_mb or s.memory_mb
        cpu = limits.cpu_s or min(math.ceil(wall) + 1.0, s.max_cpu_seconds)
        for name, value, maximum in (
            ("timeout_s", wall, s.max_wall_seconds),
            ("memory_mb", memory, s.max_memory_mb),
            ("cpu_s", cpu, s.max_cpu_seconds),
        ):
            if not 0 < value <= maximum:
                raise ValueError(f"{name}={value} is outside (0, {maximum}]: ask for at most {maximum}")
        setup = {
            "code": code,
            "files": {path: base64.b64encode(data).decode("ascii") for path, data in (files or {}).items()},
            "argv": ["main.py"],
        }
        async with self._concurrency:
            stdin_r, stdin_w = os.pipe()
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            stdin_handoff = [stdin_w]  # _run_execution takes it; closed here only if it never did
            try:
                limits_dict = self._limits(cpu_s=cpu, memory_mb=memory)
                async with self._jail("exec", limits_dict, [stdin_r, out_w, err_w]) as (spawned, zygote, channel):
                    channel.max_frame = 1 << 16  # pid 1's report is a few numbers
                    try:
                        return await run_execution(
                            channel,
                            setup,
                            stdin,
                            stdin_handoff.pop(),
                            out_r,
                            err_r,
                            wall=wall,
                            cpu=cpu,
                            stdout_cap=s.stdout_bytes,
                            stderr_cap=s.stderr_bytes,
                            stop=lambda: self._finish_now(zygote, spawned),
                        )
                    except SandboxFault:
                        self.faults += 1
                        raise
            finally:
                for fd in (*stdin_handoff, out_r, err_r):
                    os.close(fd)

    async def _finish_now(self, zygote: Zygote, spawned: Spawned) -> dict[str, Any] | None:
        """Kill the request now if it still runs; its ``exited`` message, or ``None`` if lost."""
        await zygote.kill(spawned)
        try:
            async with asyncio.timeout(EXIT_GRACE_S):
                return await asyncio.shield(spawned.exited)
        except (SandboxFault, TimeoutError):
            return None

    # -- sessions ------------------------------------------------------------------------------
    async def open_session(self, code: str, setting: str, seed: int, config: CheckConfig) -> SandboxSession:
        """Start an env session: load ``code`` in a fresh jail and ``reset(seed)`` it.

        The code loaded is what ``spade.envs.repair_code`` makes of ``code``, decided by this
        service (``Repairs``), never by a jail.

        Returns:
            the live session; its ``initial`` outcome says how reset went (see
            ``services.sandbox.isolation.session``). A session whose reset failed is already closed.
        """
        s = self.settings
        limits = self._limits(cpu_s=s.session_cpu_seconds, memory_mb=s.memory_mb)
        prepared = await self.repairs.prepare(code)
        request: dict[str, Any] = {
            "code": prepared.code,
            "repaired": prepared.repaired,
            "setting": setting,
            "seed": seed,
            "config": config.to_dict(),
        }
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        jail = self._jail("session", limits, [theirs.detach()])
        try:
            spawned, zygote, witness = await jail.__aenter__()
        except SandboxFault as exc:
            mine.close()
            self.faults += 1
            return SandboxSession.failed(ended_outcome(Outcome.SANDBOX_FAULT, str(exc), None))
        except BaseException:
            mine.close()
            raise
        witness.max_frame = 1 << 16  # pid 1's report is a few numbers
        channel = await Channel.open(mine, s.observation_bytes)
        session = SandboxSession(
            jail,
            spawned,
            zygote,
            channel,
            s.step_seconds,
            witness=witness,
            max_turns=config.max_turns_cap,
            cpu_limit_s=float(limits["cpu_seconds"]),
            on_fault=self._count_fault,
            on_close=self._sessions.discard,
        )
        self._sessions.add(session)
        try:
            await session.begin(request, s.session_start_seconds)
        except BaseException:  # cancelled while opening: nobody will ever close it
            await asyncio.shield(session.close())
            raise
        return session

    def _count_fault(self) -> None:
        self.faults += 1

    # -- validation ----------------------------------------------------------------------------
    async def validate(self, code: str, setting: str, config: CheckConfig) -> ValidationReport:
        """Run ``spade.envs.check_env_source`` on ``code``, every episode it plays a real session.

        Validation is indistinguishable from play: each episode a check plays is a session opened
        by ``open_session``, exactly as a rollout's play is (its own jail, the same env process and
        host code), on seeds drawn in secret from the play seed distribution; ``solution()`` is
        computed in one session and replayed in a fresh one (``services.sandbox.isolation.validation``).
        The checker runs in a worker thread of this process and never runs env code, so the verdict
        cannot be written or altered by the code it judges. The report's ``repaired_code`` is what
        this service made of ``code``. Past ``validate_wall_seconds`` the validation is stopped and
        the report names the check that was running.

        Raises:
            ValueError: a bad ``setting``.
        """
        repaired = await self.repairs.repaired(code)
        async with self._concurrency:
            report = await validate_in_sessions(
                self.open_session, code, setting, config, self.settings.validate_wall_seconds
            )
        return dataclasses.replace(report, repaired_code=repaired)


__all__ = ["SandboxPool", "SandboxSession"]
