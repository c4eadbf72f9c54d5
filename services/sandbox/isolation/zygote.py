"""The service's side of one zygote: launch it inside its outer sandbox, ask it to spawn, hear exits.

The zygote is started as ``setpriv … bwrap … python3.11 -I -S /opt/spade/…/zygote.py CONFIG`` with
one end of a socketpair inherited. Spawn requests carry the request's own channel fds (SCM_RIGHTS);
the zygote answers when the request's jail has ended (how), or that it could not start one. If the
zygote dies every request still running on it fails with ``SandboxFault`` (its children die with it
through PDEATHSIG).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import socket
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.sandbox.isolation.cgroups import CgroupPlan
from services.sandbox.isolation.outcomes import SandboxFault
from services.sandbox.isolation.settings import IsolationSettings
from services.sandbox.isolation.staging import MOUNT_POINT
from services.sandbox.runtime.protocol import FrameDecoder, ProtocolError, encode_frame
from spade.serving.logs import get_logger

log = get_logger(__name__)

ZYGOTE_SCRIPT = "services/sandbox/runtime/zygote.py"
READY_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class ZygotePlan:
    """How to launch a zygote, decided once from the settings and the available layers."""

    settings: IsolationSettings
    staging: Path
    use_setpriv: bool
    use_bwrap: bool
    use_userns: bool
    use_seccomp: bool
    cgroup: CgroupPlan = field(default_factory=lambda: CgroupPlan(None))

    def command(self, ctl_fd: int) -> list[str]:
        s = self.settings
        root = MOUNT_POINT if self.use_bwrap else str(self.staging)
        config = {
            "ctl_fd": ctl_fd,
            "seccomp": self.use_seccomp,
            "seccomp_path": str(s.seccomp_path),
            "userns": self.use_userns,
            "inner_uid": s.uid,
            "inner_gid": s.gid,
            "tmpfs_bytes": s.tmpfs_mb << 20,
            "spares": s.spares,
            # Names this pool's processes in `ps` (and lets tests find any that outlive it).
            "instance": str(self.staging),
        }
        # Not -I: it implies -E, and the hash seed must come from PYTHONHASHSEED (set below, and the
        # only variable the process sees). A fixed seed makes set/dict-of-str iteration order, hence an
        # env's instances, the same in every jail, zygote and replica: both regret arms then face the
        # same instances. -P -s -S keep the isolation -I gave (no script dir, user site or site).
        argv = [str(s.python), "-P", "-s", "-S", "-B", f"{root}/{ZYGOTE_SCRIPT}", json.dumps(config)]
        if self.use_bwrap:
            argv = [
                str(s.bwrap),
                "--unshare-all",
                "--unshare-user",  # explicit: bwrap run by root would otherwise skip it
                "--die-with-parent",
                "--new-session",
                "--clearenv",
                "--setenv", "PYTHONHASHSEED", "0",
                "--ro-bind", "/usr", "/usr",
                "--symlink", "usr/lib", "/lib",
                "--symlink", "usr/lib64", "/lib64",
                "--symlink", "usr/bin", "/bin",
                "--proc", "/proc",
                "--dev", "/dev",
                "--tmpfs", "/tmp",
                "--ro-bind", str(self.staging), MOUNT_POINT,
                "--uid", "0",
                "--gid", "0",
                "--cap-add", "ALL",
                "--remount-ro", "/dev",
                "--remount-ro", "/",
                "--chdir", "/tmp",
                "--",
                *argv,
            ]  # fmt: skip
        if self.use_setpriv:
            argv = [str(s.setpriv), f"--reuid={s.uid}", f"--regid={s.gid}", "--clear-groups", "--", *argv]
        # Outermost: still the service's identity, it moves itself into the pool's cgroup, then execs.
        return [*self.cgroup.launcher(), *argv]


@dataclass
class Spawned:
    """One request's processes as the zygote knows them.

    Attributes:
        request_id: the id the zygote uses for it.
        exited: resolves to the zygote's ``exited`` message (``code`` or ``signal``), or fails with
            ``SandboxFault`` if the zygote dies first.
    """

    request_id: int
    exited: asyncio.Future[dict[str, Any]]


@dataclass
class Zygote:
    """A running zygote. Use ``await Zygote.launch(plan)``."""

    plan: ZygotePlan
    process: asyncio.subprocess.Process
    sock: socket.socket
    ready: dict[str, Any]
    requests: dict[int, Spawned] = field(default_factory=dict)
    alive: bool = True
    died: asyncio.Event = field(default_factory=asyncio.Event)
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    _send_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _reader: asyncio.Task[None] | None = None

    @classmethod
    async def launch(cls, plan: ZygotePlan) -> Zygote:
        """Start a zygote and wait for its ``ready`` message.

        Raises:
            SandboxFault: when it exits or says nothing within the start-up timeout.
        """
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        identity: dict[str, Any] = {}
        if not plan.use_setpriv and os.geteuid() == 0:
            # Without setpriv a root service still switches to the sandbox uid itself.
            identity = {"user": plan.settings.uid, "group": plan.settings.gid, "extra_groups": []}
        try:
            process = await asyncio.create_subprocess_exec(
                *plan.command(child.fileno()),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                pass_fds=(child.fileno(),),
                env={"PYTHONHASHSEED": "0"},
                cwd="/",
                start_new_session=True,
                **identity,
            )
        finally:
            child.close()
        parent.setblocking(False)
        decoder = FrameDecoder(max_frame=1 << 20)
        loop = asyncio.get_running_loop()
        try:
            messages: list[dict[str, Any]] = []
            async with asyncio.timeout(READY_TIMEOUT_S):
                while not messages:
                    data = await loop.sock_recv(parent, 1 << 16)
                    if not data:
                        raise SandboxFault(f"the zygote exited during start-up (exit {await process.wait()})")
                    messages = decoder.feed(data)
        except BaseException as exc:  # including cancellation: never leave a zygote behind
            parent.close()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, 9)
            await asyncio.shield(process.wait())
            if isinstance(exc, TimeoutError | ProtocolError):
                raise SandboxFault(f"the zygote did not become ready: {exc or 'timeout'}") from None
            raise
        ready = messages.pop(0)
        if ready.get("op") != "ready":
            parent.close()
            process.kill()
            await process.wait()
            raise SandboxFault(f"the zygote said {ready.get('op')!r} instead of ready")
        zygote = cls(plan=plan, process=process, sock=parent, ready=ready)
        zygote._reader = asyncio.create_task(zygote._read_forever(decoder, messages))
        return zygote

    async def _read_forever(self, decoder: FrameDecoder, backlog: list[dict[str, Any]]) -> None:
        loop = asyncio.get_running_loop()
        try:
            for message in backlog:
                self._dispatch(message)
            while True:
                data = await loop.sock_recv(self.sock, 1 << 16)
                if not data:
                    break
                for message in decoder.feed(data):
                    self._dispatch(message)
        except (OSError, ProtocolError) as exc:
            log.error("zygote channel failed: %s", exc)
        finally:
            self._die("the zygote died")

    def _dispatch(self, message: dict[str, Any]) -> None:
        op = message.get("op")
        request = self.requests.get(int(message.get("id", -1)))
        if request is None:
            return
        if op == "exited":
            self.requests.pop(request.request_id, None)
            if not request.exited.done():
                request.exited.set_result(message)
        elif op == "failed":
            self.requests.pop(request.request_id, None)
            if not request.exited.done():
                request.exited.set_exception(SandboxFault(f"zygote could not spawn: {message.get('error')}"))

    def _die(self, reason: str) -> None:
        if not self.alive:
            return
        self.alive = False
        self.died.set()
        for request in self.requests.values():
            if not request.exited.done():
                request.exited.set_exception(SandboxFault(reason))
        self.requests.clear()
        with contextlib.suppress(OSError):
            self.sock.close()

    async def _send(self, message: dict[str, Any], fds: list[int] | None = None) -> None:
        if not self.alive:
            raise SandboxFault("the zygote is not running")
        data = encode_frame(message)
        loop = asyncio.get_running_loop()
        async with self._send_lock:
            try:
                if fds:
                    while True:
                        try:
                            sent = socket.send_fds(self.sock, [data], fds)
                            break
                        except BlockingIOError:
                            await _writable(loop, self.sock)
                    data = data[sent:]
                if data:
                    await loop.sock_sendall(self.sock, data)
            except OSError as exc:
                self._die(f"the zygote's channel broke: {exc}")
                raise SandboxFault(f"the zygote's channel broke: {exc}") from None

    async def spawn(self, kind: str, limits: dict[str, int], fds: list[int]) -> Spawned:
        """Ask for a new jailed process of ``kind`` served on ``fds`` (which the caller then closes)."""
        request = Spawned(next(self._ids), asyncio.get_running_loop().create_future())
        self.requests[request.request_id] = request
        try:
            await self._send(
                {"op": "spawn", "id": request.request_id, "kind": kind, "limits": limits, "nfds": len(fds)}, fds
            )
        except BaseException:
            self.requests.pop(request.request_id, None)
            raise
        return request

    async def kill(self, request: Spawned) -> None:
        """SIGKILL the request's pid 1: its pid namespace, and so every process of it, dies."""
        if request.exited.done() or not self.alive:
            return
        with contextlib.suppress(SandboxFault):
            await self._send({"op": "kill", "id": request.request_id})

    @property
    def in_flight(self) -> int:
        return len(self.requests)

    async def close(self, timeout_s: float = 5.0) -> None:
        """Close the channel (the zygote then kills its children and exits) and wait for it."""
        self._die("the sandbox pool is stopping")
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        try:
            async with asyncio.timeout(timeout_s):
                await self.process.wait()
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, 9)
            await self.process.wait()


async def _writable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    future: asyncio.Future[None] = loop.create_future()

    def ready() -> None:
        if not future.done():
            future.set_result(None)

    loop.add_writer(sock.fileno(), ready)
    try:
        await future
    finally:
        loop.remove_writer(sock.fileno())
