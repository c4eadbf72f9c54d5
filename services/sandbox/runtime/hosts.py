"""Env hosts: the processes where env code runs while a jail's pid 1 checks it.

In a validation jail, pid 1 is the checker and runs no env code. Each ``ForkedHost`` is a child it
forks: the child keeps only its own end of a fresh socketpair (on fd 3; 0-2 are ``/dev/null``),
loads the env's code and answers ``spade.envs.remote.EnvHost`` requests, one frame each way. The
child cannot reach the service's channel (closed before any env code runs), the checker's memory
(not dumpable; ``ptrace`` and ``process_vm_*`` refused by seccomp) or the checker itself (signals
from inside a pid namespace to its init are dropped by the kernel, SIGKILL included).

Standard library only: runs inside the sandbox.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
from typing import Any

from services.sandbox.runtime import jail
from services.sandbox.runtime.protocol import MEMORY_EXIT, ProtocolError, recv_frame, send_frame

HOST_MAX_FRAME = 16 << 20
"""Largest reply the checker reads from a host (an observation, a state, a solution)."""


def serve_host(sock: socket.socket, max_frame: int = HOST_MAX_FRAME) -> int:
    """Answer ``EnvHost`` requests on ``sock`` until it closes; returns the exit code."""
    from spade.envs.remote import EnvHost

    host = EnvHost()
    try:
        while True:
            message = recv_frame(sock, max_frame)
            if message is None:
                return 0
            reply = host.handle(message)
            try:
                send_frame(sock, reply)
            except (TypeError, ValueError) as exc:  # a value JSON cannot carry (made safe above; belt and braces)
                send_frame(sock, {"ok": False, "kind": "raised", "type": "ValueError", "message": str(exc)[:200]})
            if reply.get("fatal"):
                return MEMORY_EXIT
    except MemoryError:
        return MEMORY_EXIT
    except (OSError, ProtocolError):
        return 0


def describe_end(status: int, cpu_s: float) -> str:
    """How a host's process ended, for a finding (``status`` as from ``waitpid``)."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = str(sig)
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu_s >= 1.0):
            return f"the env's process used up its CPU-time limit ({name} after {cpu_s:.1f} s of CPU)"
        return f"the env's process was killed by signal {sig} ({name})"
    code = os.waitstatus_to_exitcode(status)
    if code == MEMORY_EXIT:
        return "the env's process ran out of its memory limit"
    return f"the env's process exited (code {code}) instead of answering"


class ForkedHost:
    """A link (``spade.envs.remote.Link``) to an env host forked from this process.

    Args:
        max_frame: Largest reply accepted; a larger one ends the host as a protocol breach.
    """

    def __init__(self, max_frame: int = HOST_MAX_FRAME) -> None:
        self.max_frame = max_frame
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        pid = os.fork()
        if pid == 0:  # the host: nothing of the checker's channels survives into it
            code = 70
            try:
                mine.close()
                null = os.open("/dev/null", os.O_RDWR)
                jail.keep_fds([null, null, null, theirs.fileno()])
                os.setpgid(0, 0)
                code = serve_host(socket.socket(fileno=3), max_frame)
            except MemoryError:
                code = MEMORY_EXIT
            finally:
                os._exit(code)
        theirs.close()
        self.pid = pid
        self.sock = mine
        self.ended: str | None = None

    def request(self, message: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        from spade.envs.remote import HostGone, HostTimeout

        if self.ended is not None:
            raise HostGone(self.ended)
        self.sock.settimeout(timeout_s)
        try:
            send_frame(self.sock, message)
            reply = recv_frame(self.sock, self.max_frame)
        except TimeoutError:
            self.close()
            raise HostTimeout(f"no answer within {timeout_s:g} s") from None
        except ProtocolError as exc:
            self.close()
            raise HostGone(f"the env's process broke the host protocol ({exc})") from None
        except OSError:
            reply = None
        if reply is None:
            raise HostGone(self._finish())
        return reply

    def _finish(self) -> str:
        """Wait for the host's end (killing it if it lingers) and say how it ended."""
        self.sock.close()
        try:
            _, status, usage = os.wait4(self.pid, os.WNOHANG)
            if _ == 0:
                self._kill()
                _, status, usage = os.wait4(self.pid, 0)
            self.ended = describe_end(status, usage.ru_utime + usage.ru_stime)
        except ChildProcessError:
            self.ended = "the env's process ended"
        self._sweep()
        return self.ended

    def _kill(self) -> None:
        for kill in (os.killpg, os.kill):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                kill(self.pid, signal.SIGKILL)

    def _sweep(self) -> None:
        """Kill whatever the host left behind, and reap it."""
        if os.getpid() == 1:
            # Init of the jail's pid namespace: -1 is every other process in it, and only hosts
            # (and what they forked) are there. Never done outside a namespace of our own.
            with contextlib.suppress(ProcessLookupError):
                os.kill(-1, signal.SIGKILL)
        else:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return

    def close(self) -> None:
        if self.ended is not None:
            return
        self._kill()
        with contextlib.suppress(OSError):
            self.sock.close()
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)
        self.ended = "the env's process was stopped"
        self._sweep()
