"""What pid 1 of a request's namespaces does: lock itself down, then execute or play.

The zygote's child, cloned straight into the jail's namespaces; it gets the request's channels
with the assignment. After ``lock_down`` nothing here has any privilege; every message from pid 1 to the
service is a frame on the control socket (fd 3). Untrusted code never runs in pid 1: it runs in a
child, and pid 1 is a witness that child cannot silence (signals from inside a pid namespace to its
init are dropped by the kernel, SIGKILL included, and pid 1 is not dumpable).

- ``exec`` (fds: control, stdin, stdout, stderr): reads ``{"code", "files", "argv"}``, writes the
  files into the private ``/tmp``, forks the program (fds 0/1/2 bound to the pipes) and reports its
  end: ``{"op": "exit", "code" | "signal", "memory", "cpu_s"}``.
- ``session`` (fds: control, env channel): forks the env's process, which reads ``{"code",
  "setting", "seed", "config"}`` on the env channel and runs ``spade.envs.remote.SessionHost`` (an
  ``EnvSession``): ``{"op": "outcome", "outcome"}`` after reset and after each ``{"op": "step",
  "action"}``. Pid 1 reports the env process's end on the control socket, as for an execution. A
  rollout's play and every episode a validation plays are sessions alike: the service's checker
  plays through them (``services/sandbox/isolation/validation.py``), so env code cannot tell them
  apart.

Any failure of the sandbox itself is reported as ``{"op": "fault", "error"}``.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import io
import linecache
import mmap
import os
import posixpath
import signal
import socket
import sys
import traceback
import types
from typing import Any

from services.sandbox.runtime import jail
from services.sandbox.runtime.protocol import (
    HEADER,
    MEMORY_EXIT,
    decode_body,
    encode_frame,
    recv_frame,
    send_frame,
)

CTL = 3
ENV_CHANNEL = 4
"""pid 1's copy of a session's env channel (handed to the env's process, which has it on fd 3)."""
WORKDIR = "/tmp"
PROGRAM_NAME = "main.py"


def preload() -> dict[str, Any]:
    """Import and exercise the env library in the zygote so that children inherit it warm.

    One session of each example env is loaded and played a step here, once: the imports, compiled
    regular expressions and lazily built tables are then shared (copy-on-write) by every child.
    """
    try:
        from spade.envs import CheckConfig, EnvSession, Setting
        from spade.envs.remote import SessionHost  # noqa: F401
    except Exception as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    warmed = []
    try:
        from spade.envs.examples import EXAMPLES

        for example in EXAMPLES.values():
            session = EnvSession(example.code, example.setting, 0, CheckConfig())
            session.reset()
            session.step(
                "\\boxed{warm-up}" if example.setting is Setting.GAME else '{"name": "warm_up", "arguments": {}}'
            )
            warmed.append(example.name)
    except Exception as exc:
        return {"ok": True, "warm_up": f"skipped after {warmed}: {type(exc).__name__}: {exc}"}
    return {"ok": True, "warm_up": warmed}


def set_environment(workdir: str) -> None:
    """Make the environment the whole of what a request's processes see (none of the service's)."""
    os.environ.clear()
    os.environ.update({"HOME": workdir, "TMPDIR": workdir, "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})


def degraded_workdir(jail_pid: int) -> str:
    """The working directory of a request without namespaces (named after the jail's first process)."""
    import tempfile

    return os.path.join(tempfile.gettempdir(), f"spade-req-{jail_pid}")


def report_fault(fd: int, error: str) -> None:
    """Best-effort fault report on the control channel at ``fd`` (sandbox failures only)."""
    with contextlib.suppress(OSError):
        os.write(fd, encode_frame({"op": "fault", "error": error[:2000]}))


def lock_down(program: bytes | None) -> None:
    """Drop every privilege: no_new_privs, capabilities, dumpability, then the seccomp filter."""
    jail.prctl(jail.PR_SET_NO_NEW_PRIVS, 1)
    jail.drop_capabilities()
    jail.prctl(jail.PR_SET_DUMPABLE, 0)
    if program is not None:
        jail.load_seccomp(program)


def _receive_assignment(sock: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    data, fds, _, _ = socket.recv_fds(sock, 1 << 16, 8)
    if not data:
        return None
    while len(data) < HEADER.size or len(data) < HEADER.size + HEADER.unpack_from(data)[0]:
        more = sock.recv(1 << 16)
        if not more:
            return None
        data += more
    return decode_body(data[HEADER.size :]), list(fds)


def run(config: dict[str, Any], program: bytes | None, assignment_fd: int) -> int:
    """Pid 1 of a jail: finish and lock it, wait for a request, serve it; returns the exit code.

    Called in the zygote's child (``jail.fork_into_namespaces``, or a plain fork in the degraded mode
    without namespaces), which then exits with the code returned. Everything up to the wait happens
    ahead of time (the zygote keeps spares), so a request only pays for its own work. The request's
    limits are applied on arrival (lowering rlimits needs no privilege).
    """
    jail.reset_signals()
    jail.keep_fds([assignment_fd, 2])  # 0: the assignment socket, 1: the service's log (for set-up failures)
    userns = bool(config.get("userns", True))
    try:
        os.setpgid(0, 0)  # without namespaces the jail is this process group, killed as one
        if userns:
            inner = (int(config["inner_uid"]), int(config["inner_gid"]))
            outer = (int(config["outer_uid"]), int(config["outer_gid"]))
            jail.finish_namespaces(inner, outer, int(config["tmpfs_bytes"]))
        # If the zygote died before this, no signal will come; the assignment socket's end of file
        # (below) then ends this jail instead.
        jail.prctl(jail.PR_SET_PDEATHSIG, signal.SIGKILL)
        workdir = WORKDIR
        if not userns:
            # Degraded mode: no private tmpfs; a fresh directory the zygote removes after the request.
            workdir = degraded_workdir(os.getpid())
            os.mkdir(workdir, 0o700)
    except Exception as exc:
        with contextlib.suppress(OSError):
            os.write(1, f"sandbox jail set-up failed: {exc}\n".encode())
        return 71
    jail.keep_fds([0])  # the zygote's log is closed from here on
    lock_down(program)
    os.chdir(workdir)
    if not userns:
        set_environment(workdir)  # with namespaces the zygote set it once for every jail
    waiter = Waiter.fork()  # ahead of time too: a request pays for no fork
    assignment = socket.socket(fileno=0)
    received = _receive_assignment(assignment)
    assignment.detach()
    if received is None:
        waiter.discard()
        return 0  # a spare the zygote no longer needs
    request, fds = received
    kind = str(request["kind"])
    if kind == "exec":
        waiter.keep_fds([fds[1], fds[2], fds[3], fds[0]])
    else:
        null = os.open("/dev/null", os.O_RDWR)
        waiter.keep_fds([null, null, null, *fds])  # control on 3 (a session's env channel on 4)
    # A disposition, not a handler: pid 1 still receives no signal from inside its namespace, and a
    # write to a peer that went away is an EPIPE (in degraded mode pid 1 is an ordinary process).
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    limits = dict(request["limits"])
    try:
        # Not the request's open-file limit: pid 1 must still pass the channels to the waiter.
        jail.apply_rlimits(jail.Limits.from_dict(limits), open_files=False)
    except Exception as exc:
        waiter.discard()
        report_fault(CTL, f"applying the request's limits failed: {exc}")
        return 71
    ctl = socket.socket(fileno=CTL)
    serve = {"exec": run_exec, "session": run_session}[kind]
    try:
        return serve(ctl, waiter, limits)
    except Exception as exc:  # the runtime's own failure: say so rather than vanish
        waiter.discard()
        report_fault(CTL, f"{kind} worker failed: {type(exc).__name__}: {exc}")
        return 70


# -- the waiter: the request's untrusted part, forked ahead of time ----------------------------


class Waiter:
    """A child of pid 1, forked while the jail waits for its request, that will run the untrusted
    part of it (an execution's program, a session's env) once handed its channels.

    It keeps only its handoff socket; everything else of pid 1's is closed before the request
    arrives, and nothing of pid 1's is handed to it but the request's own channels (an execution's
    program gets its stdin, stdout and stderr: no way to say anything to pid 1 but by how it ends).
    Pid 1 stays the witness of how it ends (``wait``).
    """

    def __init__(self, pid: int, sock: socket.socket) -> None:
        self.pid = pid
        self.sock = sock

    @classmethod
    def fork(cls) -> Waiter:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        pid = os.fork()
        if pid == 0:
            code = 70
            try:
                code = _await_work(theirs.fileno())
            except MemoryError:
                code = MEMORY_EXIT
            finally:
                os._exit(code)
        theirs.close()
        return cls(pid, mine)

    def keep_fds(self, fds: list[int]) -> None:
        """``jail.keep_fds(fds)`` in pid 1, keeping this waiter's socket (after ``fds``)."""
        sock = self.sock.detach()
        jail.keep_fds([*fds, sock])
        self.sock = socket.socket(fileno=len(fds))

    def hand(self, work: dict[str, Any], fds: list[int]) -> None:
        """Give the waiter its work and channels (the caller then closes its copies of ``fds``)."""
        data = encode_frame(work)
        sent = socket.send_fds(self.sock, [data], fds)
        if sent < len(data):
            self.sock.sendall(data[sent:])

    def wait(self, memory_bytes: int | None = None) -> dict[str, Any]:
        """Wait for the waiter's end; pid 1's ``exit`` report of it.

        Args:
            memory_bytes: An execution's address-space limit. Its program stops itself once it has
                filled its address space after a ``MemoryError`` (``run_program``); pid 1 then reads
                the stopped process's size in ``/proc`` itself, and reports ``memory`` only if it was
                at the limit and then failed. A program can reach that state on purpose (it is then
                at its limit), never report it without. ``None`` (a session): the env's process exits
                with ``MEMORY_EXIT`` (an outcome it may claim about itself).
        """
        self.sock.close()
        at_limit = False
        while True:
            try:
                _, status, usage = os.wait4(self.pid, os.WUNTRACED if memory_bytes is not None else 0)
            except InterruptedError:
                continue
            if not os.WIFSTOPPED(status):
                break
            assert memory_bytes is not None
            at_limit = at_limit or address_space(self.pid) >= memory_bytes - AT_LIMIT_SLACK
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGCONT)
        message: dict[str, Any] = {"op": "exit", "cpu_s": usage.ru_utime + usage.ru_stime, "memory": False}
        if os.WIFSIGNALED(status):
            message["signal"] = os.WTERMSIG(status)
        else:
            code = message["code"] = os.waitstatus_to_exitcode(status)
            # A program that stopped at its limit and then exited 0 went on fine: not a failure.
            message["memory"] = code == MEMORY_EXIT if memory_bytes is None else at_limit and code != 0
        return message

    def discard(self) -> None:
        """No work for it: it ends when its handoff socket closes."""
        with contextlib.suppress(OSError):
            self.sock.close()
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)


AT_LIMIT_SLACK = 1 << 20
"""How far under its address-space limit a stopped program may be and still count as at it."""


def address_space(pid: int) -> int:
    """The size of ``pid``'s address space in bytes (``VmSize`` in ``/proc``), 0 if unreadable."""
    try:
        with open(f"/proc/{pid}/status", "rb") as handle:
            for line in handle:
                if line.startswith(b"VmSize:"):
                    return int(line.split()[1]) << 10
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _await_work(handoff_fd: int) -> int:
    """The waiter: keep only the handoff socket, then do the work it is handed."""
    jail.keep_fds([handoff_fd])  # handoff on 0
    received = _receive_assignment(socket.socket(fileno=0))
    if received is None:
        return 0
    work, fds = received
    jail.apply_rlimits(jail.Limits.from_dict(dict(work["limits"])))
    if work["kind"] == "exec":
        jail.keep_fds([fds[0], fds[1], fds[2]])  # the program's stdio, and nothing else
        run_program(str(work["code"]), list(work.get("argv") or [PROGRAM_NAME]))
    null = os.open("/dev/null", os.O_RDWR)
    jail.keep_fds([null, null, null, fds[0]])  # the env channel on 3
    return serve_session(socket.socket(fileno=3))


# -- execution ---------------------------------------------------------------------------------


def _write_files(files: dict[str, str]) -> None:
    for path, content in files.items():
        normal = posixpath.normpath(path)
        if normal.startswith(("/", "..")) or normal in (".", ""):
            raise ValueError(f"file path {path[:80]!r} is outside the working directory")
        parent = posixpath.dirname(normal)
        if parent:
            os.makedirs(parent, exist_ok=True)
        with open(normal, "wb") as handle:
            handle.write(base64.b64decode(content))


def run_exec(ctl: socket.socket, waiter: Waiter, limits: dict[str, Any]) -> int:
    setup = recv_frame(ctl)
    if setup is None:
        waiter.discard()
        return 0
    try:
        _write_files(dict(setup.get("files") or {}))
    except (OSError, ValueError) as exc:
        waiter.discard()
        # The files are the caller's data (too large for the limits, clashing paths): their error,
        # reported like a program that failed before it started.
        reason = exc.strerror if isinstance(exc, OSError) else str(exc)
        with contextlib.suppress(OSError):
            os.write(2, f"could not write the execution's files: {reason}\n".encode())
        file_limit = isinstance(exc, OSError) and exc.errno in (errno.EFBIG, errno.ENOSPC)
        send_frame(ctl, {"op": "exit", "code": 1, "file_limit": file_limit, "setup_error": reason})
        return 0
    work = {"kind": "exec", "limits": limits, "code": str(setup["code"]), "argv": setup.get("argv")}
    waiter.hand(work, [0, 1, 2])
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):  # the program alone holds its pipes: their end is its end
        os.dup2(null, fd)
    os.close(null)
    send_frame(ctl, waiter.wait(memory_bytes=int(limits["memory_bytes"])))
    return 0


def run_program(code: str, argv: list[str]) -> None:
    """Run ``code`` as ``__main__`` the way ``python main.py`` would, then exit this process.

    The program holds nothing but its stdio: how it ends is all pid 1 learns from it. Two of its
    ends are the kernel's to tell: a write past the file-size limit raises SIGXFSZ, which kills it
    (its default action, left in place), and an uncaught ``MemoryError`` is proven at the
    address-space limit by ``_stop_at_memory_limit`` for pid 1 to measure.
    """
    exit_code = 0
    # The dispositions a fresh interpreter sets up (the zygote's children start from defaults),
    # but SIGXFSZ: its default action is how a file over the limit ends the program, for pid 1 to see.
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        sys.argv = argv
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", write_through=False)
        sys.stderr = io.TextIOWrapper(
            io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace", line_buffering=True
        )
        for name in ("stdin", "stdout", "stderr"):
            setattr(sys, f"__{name}__", getattr(sys, name))
        filename = os.path.join(os.getcwd(), PROGRAM_NAME)
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
        module = types.ModuleType("__main__")
        module.__file__ = filename
        sys.modules["__main__"] = module
        exec(compile(code, filename, "exec"), module.__dict__)
    except SystemExit as exc:
        exit_code = _exit_code(exc)
    except MemoryError:
        exit_code = 1
        _print_exception()
        with contextlib.suppress(BaseException):  # no proof then: pid 1 reports an error
            _stop_at_memory_limit()
    except BaseException:
        exit_code = 1
        _print_exception()
    try:
        import atexit

        atexit._run_exitfuncs()
    except BaseException:
        pass
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()
    os._exit(exit_code)


def _stop_at_memory_limit() -> None:
    """Fill what is left of the address space with reservations (never touched: no memory is used)
    until the kernel refuses a page, then stop: pid 1 measures the stopped process (``Waiter.wait``)
    and continues it. A program can do the same, but then it has reached its limit: that is the fact
    pid 1 reports, not anything the program says.
    """
    held = []
    size = 1 << 46
    while size >= mmap.PAGESIZE:
        try:
            held.append(mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, prot=0))  # PROT_NONE
        except BaseException:  # ENOMEM (the limit), or no room left for the object itself
            size //= 2
    with contextlib.suppress(OSError):
        os.kill(os.getpid(), signal.SIGSTOP)
    for block in held:
        with contextlib.suppress(BaseException):
            block.close()


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    with contextlib.suppress(BaseException):
        print(exc.code, file=sys.stderr)
    return 1


def _print_exception() -> None:
    """Print the current exception like the interpreter would, without the runtime's own frame."""
    try:
        exc = sys.exc_info()[1]
        assert exc is not None
        tb = exc.__traceback__
        if tb is not None and tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next
        traceback.print_exception(type(exc), exc, tb)
    except BaseException:
        with contextlib.suppress(OSError):
            os.write(2, b"Traceback unavailable (out of memory)\nMemoryError\n")


# -- sessions and validation -------------------------------------------------------------------


def _describe(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= 500 else text[:500] + "…"


def run_session(ctl: socket.socket, waiter: Waiter, limits: dict[str, Any]) -> int:
    """Hand the env channel to the waiter (the env's process), then witness how it ends."""
    waiter.hand({"kind": "session", "limits": limits}, [ENV_CHANNEL])
    os.close(ENV_CHANNEL)
    report = waiter.wait()
    with contextlib.suppress(OSError):
        send_frame(ctl, report)
    return 0


def serve_session(channel: socket.socket) -> int:
    """The env's process: one ``spade.envs.remote.SessionHost`` reply per frame until ``close``.

    The first frame loads the code and resets it on the seed; then one outcome per step (and, for a
    validation's episodes, the answers to the checker's asks). A rollout's play and every episode a
    validation plays are served here alike, by the same code in the same kind of process.
    """
    from spade.envs.remote import SessionHost

    host = SessionHost()
    while True:
        message = recv_frame(channel)
        if message is None or message.get("op") == "close":
            return 0
        try:
            reply = host.handle(message)
        except MemoryError:
            return MEMORY_EXIT
        except Exception as exc:
            send_frame(channel, {"op": "env_error", "error": _describe(exc)})
            return 0
        send_frame(channel, reply)
        if reply.get("fatal"):
            return MEMORY_EXIT  # the interpreter is in no state to go on
        if reply.get("op") in ("env_error", "fault"):
            return 0
