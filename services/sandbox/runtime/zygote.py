"""The zygote: a pre-warmed interpreter, already inside the outer sandbox, that forks one jail per request.

Run by the service as ``python3.11 -I -S zygote.py CONFIG_JSON`` (inside bubblewrap, as the sandbox
uid). It speaks length-prefixed JSON on an inherited socket (``ctl_fd``):

- service → zygote: ``{"op": "spawn", "id", "kind", "limits", "nfds"}`` with the request's own
  channel fds attached (SCM_RIGHTS); ``{"op": "kill", "id"}``.
- zygote → service: ``{"op": "ready", ...layers}`` once; ``{"op": "exited", "id", "code" | "signal"}``
  when a request's jail has ended; ``{"op": "failed", "id", "error"}`` when none could be started.
  A spawn that succeeds is not answered: the request's own channels say so.

It never sees request data: each child talks to the service directly on the fds it was given. The
zygote is single-threaded, so forking it is safe. When its control socket closes it kills every
child and exits.
"""

from __future__ import annotations

import array
import contextlib
import gc
import json
import os
import selectors
import shutil
import signal
import socket
import sys
import traceback
from typing import Any

_STAGING = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
if _STAGING not in sys.path:
    sys.path.insert(0, _STAGING)

from services.sandbox.runtime import jail, worker  # noqa: E402
from services.sandbox.runtime.protocol import FrameDecoder, encode_frame  # noqa: E402

MAX_FDS = 8
FDS = {"exec": 4, "session": 2}
"""The request kinds, each with the number of channel fds it comes with (see ``worker``)."""
KINDS = tuple(FDS)


class Zygote:
    def __init__(self, config: dict[str, Any]) -> None:
        # The ids a jail's user namespace maps its one uid and gid to: the zygote's own.
        self.config = {**config, "outer_uid": os.getuid(), "outer_gid": os.getgid()}
        self.ctl = socket.socket(fileno=int(config["ctl_fd"]))
        self.ctl.setblocking(True)
        self.decoder = FrameDecoder(max_frame=1 << 20)
        self.pending_fds: list[int] = []
        self.children: dict[int, int | None] = {}  # jail (its pid 1) -> request id (None: a spare)
        self.warm: list[tuple[int, socket.socket]] = []  # spares: (pid, assignment socket)
        self.spares = int(config.get("spares", 1))
        self.by_id: dict[int, int] = {}  # request id -> pid
        self.program: bytes | None = None
        self.layers: dict[str, Any] = {}

    # -- start-up ------------------------------------------------------------------------------
    def prepare(self) -> None:
        """Everything a child should inherit ready-made: the seccomp program, preloaded modules."""
        if self.config.get("seccomp", True):
            from services.sandbox.runtime import policy

            try:
                self.program = policy.build_program(str(self.config["seccomp_path"]))
                self.layers["seccomp"] = {"ok": True, "instructions": len(self.program) // 8}
            except Exception as exc:
                self.layers["seccomp"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        else:
            self.layers["seccomp"] = {"ok": False, "error": "disabled by configuration (degraded mode)"}
        self.layers["envs"] = worker.preload()
        if self.config.get("userns", True):
            # Every jail's environment, set once here for all of them (the zygote needs none of its
            # own: the hash seed was read at start-up). Without namespaces each jail sets its own.
            worker.set_environment(worker.WORKDIR)
        # Everything allocated so far is shared with every child: keep the collector off it, so
        # children neither spend time scanning it nor copy its pages by touching them.
        gc.collect()
        gc.freeze()

    # -- main loop -----------------------------------------------------------------------------
    def serve(self) -> None:
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        os.set_blocking(wake_r, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGTERM, lambda *_: None)
        sel = selectors.DefaultSelector()
        sel.register(self.ctl, selectors.EVENT_READ, "ctl")
        sel.register(wake_r, selectors.EVENT_READ, "wake")
        ready = False
        try:
            while True:
                # Every jail is pre-forked here, from this one line, with no request's data in any
                # frame: what a jail inherits never says what came before it (a play, a validation).
                self.replenish()
                if not ready:
                    self.send({"op": "ready", "pid": os.getpid(), "uid": os.getuid(), "layers": self.layers})
                    ready = True
                for key, _ in sel.select():
                    if key.data == "wake":
                        try:
                            while os.read(wake_r, 4096):
                                pass
                        except BlockingIOError:
                            pass
                        self.reap()
                    elif not self.receive():
                        return
                self.reap()
        finally:
            self.kill_all()

    def receive(self) -> bool:
        fds = array.array("i")
        try:
            data, ancdata, _, _ = self.ctl.recvmsg(1 << 16, socket.CMSG_SPACE(MAX_FDS * fds.itemsize))
        except InterruptedError:
            return True
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[: len(payload) - (len(payload) % fds.itemsize)])
        self.pending_fds.extend(fds)
        if not data:
            return False
        for message in self.decoder.feed(data):
            self.handle(message)
        return True

    def handle(self, message: dict[str, Any]) -> None:
        op = message.get("op")
        if op == "spawn":
            nfds = int(message.get("nfds", 0))
            fds, self.pending_fds = self.pending_fds[:nfds], self.pending_fds[nfds:]
            try:
                self.spawn(int(message["id"]), str(message["kind"]), dict(message["limits"]), fds)
            finally:
                for fd in fds:
                    os.close(fd)
        elif op == "kill":
            pid = self.by_id.get(int(message["id"]))
            if pid is not None:
                kill_jail(pid)
        elif op == "ping":
            self.send({"op": "pong", "children": len(self.children), "warm": len(self.warm)})

    def prefork(self) -> tuple[int, socket.socket] | None:
        """Fork a jail's pid 1, which builds the jail and locks itself in, then waits for a request."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            pid = jail.fork_into_namespaces() if self.config.get("userns", True) else os.fork()
        except (OSError, jail.JailError) as exc:
            mine.close()
            theirs.close()
            print(f"zygote: fork failed: {exc}", file=sys.stderr, flush=True)
            return None
        if pid == 0:
            code = 70
            try:
                code = worker.run(self.config, self.program, theirs.fileno())
            except BaseException as exc:  # never let an error escape into the zygote's loop
                with contextlib.suppress(OSError):
                    os.write(1, f"sandbox jail failed: {type(exc).__name__}: {exc}\n".encode())
            finally:
                os._exit(code)
        theirs.close()
        self.children[pid] = None
        return pid, mine

    def replenish(self) -> None:
        while len(self.warm) < self.spares:
            jail = self.prefork()
            if jail is None:
                return
            self.warm.append(jail)

    def spawn(self, request_id: int, kind: str, limits: dict[str, Any], fds: list[int]) -> None:
        if kind not in KINDS or len(fds) != FDS[kind]:
            self.send({"op": "failed", "id": request_id, "error": f"bad spawn request ({kind}, {len(fds)} fds)"})
            return
        assignment = encode_frame({"kind": kind, "limits": limits})
        # A spare that died while waiting (it should not) is skipped; the last try is a fresh jail.
        for _ in range(len(self.warm) + 1):
            jail = self.warm.pop(0) if self.warm else self.prefork()
            if jail is None:
                break
            pid, sock = jail
            try:
                socket.send_fds(sock, [assignment], fds, socket.MSG_NOSIGNAL)
            except OSError:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                continue
            finally:
                sock.close()
            self.children[pid] = request_id
            self.by_id[request_id] = pid
            return
        self.send({"op": "failed", "id": request_id, "error": "no jail could be started (see the service log)"})

    def reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            request_id = self.children.pop(pid, None)
            self.cleanup(pid)
            if request_id is None:
                for jail in [j for j in self.warm if j[0] == pid]:
                    self.warm.remove(jail)
                    jail[1].close()
                continue
            self.by_id.pop(request_id, None)
            message: dict[str, Any] = {"op": "exited", "id": request_id}
            if os.WIFSIGNALED(status):
                message["signal"] = os.WTERMSIG(status)
            else:
                message["code"] = os.waitstatus_to_exitcode(status)
            self.send(message)

    def cleanup(self, jail_pid: int) -> None:
        """After a jail's first process is gone: kill what is left of its process group, remove its files.

        With namespaces the pid namespace's end already killed everything and the tmpfs vanished
        with it; in the degraded mode without them this is what stops leftovers.
        """
        if not self.config.get("userns", True):
            # Right after the reap: the id stays taken while members remain, and pids are handed out
            # cyclically, so it names no other group. With namespaces nothing is left to kill.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(jail_pid, signal.SIGKILL)
            shutil.rmtree(worker.degraded_workdir(jail_pid), ignore_errors=True)

    def kill_all(self) -> None:
        for pid in list(self.children):
            kill_jail(pid)
        for pid in list(self.children):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
            self.cleanup(pid)
        self.children.clear()

    def send(self, message: dict[str, Any]) -> None:
        # If the service is gone, the main loop sees the end of stream next.
        with contextlib.suppress(OSError):
            self.ctl.sendall(encode_frame(message))


def kill_jail(jail_pid: int) -> None:
    """SIGKILL a jail's pid 1 (its pid namespace dies with it) and its process group (it leads one)."""
    for kill in (os.killpg, os.kill):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            kill(jail_pid, signal.SIGKILL)


def main() -> None:
    config = json.loads(sys.argv[1])
    jail.raise_open_files()  # for passing channels to its jails, and theirs to their waiters
    zygote = Zygote(config)
    try:
        zygote.prepare()
    except Exception:
        traceback.print_exc()
    zygote.serve()


if __name__ == "__main__":
    main()
