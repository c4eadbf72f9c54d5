"""What pid 1 of a request's namespaces does: lock itself down, then execute, validate or play.

The zygote's child, cloned straight into the jail's namespaces; it gets the request's channels
with the assignment. After ``lock_down`` nothing here has any privilege; every message from pid 1 to the
service is a frame on the control socket (fd 3). Untrusted code never runs in pid 1: it runs in a
child, and pid 1 is a witness that child cannot silence (signals from inside a pid namespace to its
init are dropped by the kernel, SIGKILL included, and pid 1 is not dumpable).

- ``exec`` (fds: control, stdin, stdout, stderr): reads ``{"code", "files", "argv"}``, writes the
  files into the private ``/tmp``, forks the program (fds 0/1/2 bound to the pipes) and reports its
  end: ``{"op": "exit", "code" | "signal", "memory", "cpu_s"}``.
- ``session`` (fds: control, env channel): forks the env's process, which reads ``{"code",
  "setting", "seed", "config"}`` on the env channel and runs ``spade.envs.EnvSession``: ``{"op":
  "outcome", "outcome"}`` after reset and after each ``{"op": "step", "action"}``. Pid 1 reports the
  env process's end on the control socket, as for an execution.
- ``validate`` (fds: control): pid 1 runs ``spade.envs.check_env_source`` itself with the env's code
  in forked hosts (``services/sandbox/runtime/hosts.py``), streaming ``{"op": "progress", "check"}``
  before each check, then ``{"op": "report", "report"}``. Env code never shares a process or a
  channel with the checker, so it cannot write or alter the verdict.

Any failure of the sandbox itself is reported as ``{"op": "fault", "error"}``.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import io
import linecache
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
        from spade.envs import CheckConfig, EnvSession, check_env_source  # noqa: F401
        from spade.envs.remote import EnvHost, RemoteRuntime  # noqa: F401
    except Exception as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    warmed = []
    try:
        from spade.envs.examples import EXAMPLES

        for example in EXAMPLES.values():
            session = EnvSession(example.code, example.setting, 0, CheckConfig())
            session.reset()
            session.step(
                "\\boxed{warm-up}" if example.setting.value == "game" else '{"name": "warm_up", "arguments": {}}'
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
        jail.apply_rlimits(jail.Limits.from_dict(limits))
    except Exception as exc:
        waiter.discard()
        report_fault(CTL, f"applying the request's limits failed: {exc}")
        return 71
    ctl = socket.socket(fileno=CTL)
    serve = {"exec": run_exec, "session": run_session, "validate": run_validate}[kind]
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

    It keeps only its handoff socket and a marker pipe; everything else of pid 1's is closed before
    the request arrives. Pid 1 stays the witness of how it ends (``wait``).
    """

    def __init__(self, pid: int, sock: socket.socket, marker: int) -> None:
        self.pid = pid
        self.sock = sock
        self.marker = marker

    @classmethod
    def fork(cls) -> Waiter:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        marker_r, marker_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 70
            try:
                code = _await_work(theirs.fileno(), marker_w)
            except MemoryError:
                code = MEMORY_EXIT
            finally:
                os._exit(code)
        theirs.close()
        os.close(marker_w)
        return cls(pid, mine, marker_r)

    def keep_fds(self, fds: list[int]) -> None:
        """``jail.keep_fds(fds)`` in pid 1, keeping this waiter's socket and marker (after ``fds``)."""
        sock = self.sock.detach()
        jail.keep_fds([*fds, sock, self.marker])
        self.sock = socket.socket(fileno=len(fds))
        self.marker = len(fds) + 1

    def hand(self, work: dict[str, Any], fds: list[int]) -> None:
        """Give the waiter its work and channels (the caller then closes its copies of ``fds``)."""
        data = encode_frame(work)
        sent = socket.send_fds(self.sock, [data], fds)
        if sent < len(data):
            self.sock.sendall(data[sent:])

    def wait(self) -> dict[str, Any]:
        """Wait for the waiter's end; pid 1's ``exit`` report of it."""
        self.sock.close()
        while True:
            try:
                _, status, usage = os.wait4(self.pid, 0)
                break
            except InterruptedError:
                continue
        os.set_blocking(self.marker, False)
        try:
            marker = os.read(self.marker, 1)
        except BlockingIOError:
            marker = b""
        os.close(self.marker)
        message: dict[str, Any] = {
            "op": "exit",
            "memory": marker == b"M",
            "file_limit": marker == b"F",
            "cpu_s": usage.ru_utime + usage.ru_stime,
        }
        if os.WIFSIGNALED(status):
            message["signal"] = os.WTERMSIG(status)
        else:
            message["code"] = os.waitstatus_to_exitcode(status)
            message["memory"] = message["memory"] or message["code"] == MEMORY_EXIT
        return message

    def discard(self) -> None:
        """No work for it: it ends when its handoff socket closes."""
        with contextlib.suppress(OSError):
            self.sock.close()
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)
        with contextlib.suppress(OSError):
            os.close(self.marker)


def _await_work(handoff_fd: int, marker_fd: int) -> int:
    """The waiter: keep only the handoff socket and the marker, then do the work it is handed."""
    jail.keep_fds([handoff_fd, marker_fd])  # handoff on 0, marker on 1
    received = _receive_assignment(socket.socket(fileno=0))
    if received is None:
        return 0
    work, fds = received
    jail.apply_rlimits(jail.Limits.from_dict(dict(work["limits"])))
    if work["kind"] == "exec":
        jail.keep_fds([fds[0], fds[1], fds[2], 1])  # the program's stdio, the marker on 3
        run_program(str(work["code"]), list(work.get("argv") or [PROGRAM_NAME]), 3)
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
    send_frame(ctl, waiter.wait())
    return 0


def run_program(code: str, argv: list[str], marker_fd: int) -> None:
    """Run ``code`` as ``__main__`` the way ``python main.py`` would, then exit this process."""
    exit_code = 0
    # The dispositions a fresh interpreter sets up (the zygote's children start from defaults).
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
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
        os.write(marker_fd, b"M")
        exit_code = 1
        _print_exception()
    except OSError as exc:
        if exc.errno == errno.EFBIG:  # a write past RLIMIT_FSIZE
            os.write(marker_fd, b"F")
        exit_code = 1
        _print_exception()
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
    """The env's process: load and reset on the first frame, then one outcome per step."""
    request = recv_frame(channel)
    if request is None:
        return 0
    try:
        session = _load_session(request)
        outcome = session.reset()
    except MemoryError:
        return MEMORY_EXIT
    except Exception as exc:
        send_frame(channel, {"op": "env_error", "error": _describe(exc)})
        return 0
    while True:
        send_frame(channel, {"op": "outcome", "outcome": outcome.to_dict()})
        if outcome.outcome.value == "memory_limit":
            return MEMORY_EXIT  # the interpreter is in no state to go on
        message = recv_frame(channel)
        if message is None or message.get("op") == "close":
            return 0
        if message.get("op") != "step":
            send_frame(channel, {"op": "fault", "error": f"unknown session op {message.get('op')!r}"})
            return 0
        try:
            outcome = session.step(str(message["action"]))
        except Exception as exc:
            send_frame(channel, {"op": "env_error", "error": _describe(exc)})
            return 0


def _load_session(request: dict[str, Any]) -> Any:
    """An ``EnvSession`` for the request's code, repaired only where it needs it.

    The service sends code it has already repaired (``repaired``: true), or code its cheap test
    (``spade.envs.repair.needs_repair``) found nothing to repair in; that code is compiled as it is
    and goes through the full repairs only if it does not compile, which gives what ``repair_code``
    gives at the cost of one compile. The service's cheap test is not run again here: what code a
    session loads is the service's decision, and the jail takes it as it comes.
    """
    from spade.envs import CheckConfig, EnvLoadError, EnvSession
    from spade.envs.limits import CallTimeout, guarded
    from spade.envs.loader import compile_env, load_env_class

    code, setting, seed = str(request["code"]), str(request["setting"]), int(request["seed"])
    config = CheckConfig.from_dict(dict(request["config"]))
    compiled = None
    try:
        compiled = compile_env(code)
    except (SyntaxError, ValueError):
        if not request.get("repaired"):
            return EnvSession(code, setting, seed, config)
    try:
        with guarded(config.call_time_limit_s):
            loaded = load_env_class(code, setting, compiled)
    except CallTimeout:
        raise EnvLoadError(f"loading the env code took longer than {config.call_time_limit_s:g} s") from None
    if not loaded.ok or loaded.env_class is None:
        raise EnvLoadError("; ".join(loaded.problems))
    return EnvSession.from_class(loaded.env_class, setting, seed, config)


def run_validate(ctl: socket.socket, waiter: Waiter, limits: dict[str, Any]) -> int:
    """Check the env as pid 1, with its code in forked hosts; stream progress, then the report."""
    waiter.discard()  # the hosts are forked as the checks need them
    request = recv_frame(ctl)
    if request is None:
        return 0
    from services.sandbox.runtime.hosts import ForkedHost
    from spade.envs import CheckConfig, check_env_source
    from spade.envs.limits import disable_timers
    from spade.envs.remote import RemoteRuntime

    disable_timers()  # no SIGALRM handler in pid 1: env processes could send it one
    config = CheckConfig.from_dict(dict(request["config"]))

    def progress(name: str, result: dict[str, Any] | None = None) -> None:
        message: dict[str, Any] = {"op": "progress", "check": str(name)}
        if result is not None:
            message["result"] = result
        send_frame(ctl, message)

    runtime = RemoteRuntime(ForkedHost)
    try:
        report = check_env_source(
            str(request["code"]), str(request["setting"]), config, progress=progress, runtime=runtime
        )
    finally:
        runtime.close()
    send_frame(ctl, {"op": "report", "report": report.to_dict(), "hosts": runtime.hosts_started})
    return 0
