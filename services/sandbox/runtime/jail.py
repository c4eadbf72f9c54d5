"""Kernel primitives the zygote's children use to lock themselves in (Linux x86-64, ctypes).

The sequence for one request (see ``docs/sandbox-isolation.md``):

1. ``fork_into_namespaces``: one ``clone`` makes the jail's pid 1 in fresh user, mount, IPC,
   network, UTS, pid and cgroup namespaces; ``finish_namespaces`` (in that child) maps one uid, makes
   ``/`` private, mounts a fresh size-limited tmpfs on ``/tmp`` and a ``/proc`` of its own.
2. ``lock_down`` (``worker``): death signal, every capability dropped, ``no_new_privs``, not
   dumpable, rlimits, then the seccomp filter (built once by the zygote).

Standard library only; every failure raises ``JailError`` naming the step, so a request whose jail
could not be built never runs.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import resource
import signal
import struct
from dataclasses import dataclass

CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

NAMESPACES = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWNET | CLONE_NEWUTS | CLONE_NEWPID | CLONE_NEWCGROUP
"""The namespaces every jail gets, all at once and owned by its own user namespace."""
SYS_CLONE = 56  # x86-64; the raw syscall, since only its flags can put the child itself in a new pid namespace

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REC = 0x4000
MS_PRIVATE = 1 << 18

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_SECCOMP = 22
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
SECCOMP_MODE_FILTER = 2
LINUX_CAPABILITY_VERSION_3 = 0x20080522
CAP_LAST_CAP = 63  # beyond the kernel's last cap, PR_CAPBSET_DROP answers EINVAL: we stop there

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
_libc.capset.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
_libc.sethostname.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
# The clone runs with the GIL held, as os.fork's fork() does (a CDLL call would release it around).
_libc_gil = ctypes.PyDLL(None, use_errno=True)
_libc_gil.syscall.restype = ctypes.c_long
_libc_gil.syscall.argtypes = [ctypes.c_long, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]


class JailError(Exception):
    """One step of building the jail failed; the message names the step and the errno."""


def _check(result: int, step: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise JailError(f"{step}: {errno.errorcode.get(err, err)} ({os.strerror(err)})")


def prctl(option: int, arg2: int = 0, arg3: int = 0, arg4: int = 0, arg5: int = 0) -> None:
    _check(_libc.prctl(option, arg2, arg3, arg4, arg5), f"prctl({option})")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(
        _libc.mount(
            source.encode() if source else None,
            target.encode(),
            fstype.encode() if fstype else None,
            flags,
            data.encode() if data else None,
        ),
        f"mount({fstype or source} on {target})",
    )


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    except OSError as exc:
        raise JailError(f"write {path}: {exc.strerror}") from None
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Limits:
    """Resource limits of one request, applied as rlimits."""

    cpu_seconds: int
    memory_bytes: int
    processes: int
    open_files: int
    file_size_bytes: int

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> Limits:
        return cls(**{name: int(data[name]) for name in cls.__dataclass_fields__})  # type: ignore[call-overload]


def fork_into_namespaces() -> int:
    """A fork whose child is pid 1 of fresh namespaces (``NAMESPACES``); 0 in the child.

    A fork that then unshares would need a second fork (a new pid namespace applies to children
    only), and so a third process per jail; one ``clone`` with the namespace flags makes the child
    itself pid 1. The child then calls ``finish_namespaces``.

    Unlike ``os.fork`` it runs none of CPython's fork hooks (``PyOS_AfterFork_Child`` and the
    ``os.register_at_fork`` callbacks: threading's, random's reseed): in the child they only touch,
    and so copy, a few hundred of the zygote's pages, and nothing needs them there. The zygote is
    single-threaded and not importing when it clones, so no lock (the GIL's, the import lock, the C
    library's) is held by anyone but this thread, which goes on in the child. The child runs only
    the runtime's own code; untrusted code runs in processes it forks with ``os.fork``, which runs
    every hook (a program's ``random`` is reseeded there).
    """
    pid = _libc_gil.syscall(SYS_CLONE, NAMESPACES | signal.SIGCHLD, None, None, None)
    if pid < 0:
        err = ctypes.get_errno()
        raise JailError(f"clone(new namespaces): {errno.errorcode.get(err, err)} ({os.strerror(err)})")
    return int(pid)


def finish_namespaces(inner: tuple[int, int], outer: tuple[int, int], tmpfs_bytes: int) -> None:
    """As pid 1 of ``fork_into_namespaces``: map one uid and gid, mount a private ``/tmp`` and ``/proc``.

    ``outer`` is the zygote's (uid, gid), read before the clone (in here they are not mapped yet); as
    the child's own ids, mapping them needs no privilege beyond the zygote's. The ``/proc`` shows
    only this pid namespace.
    """
    (inner_uid, inner_gid), (outer_uid, outer_gid) = inner, outer
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"{inner_uid} {outer_uid} 1")
    _write("/proc/self/gid_map", f"{inner_gid} {outer_gid} 1")
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={tmpfs_bytes},mode=0700,nr_inodes=16384")
    hostname = b"sandbox"
    _check(_libc.sethostname(hostname, len(hostname)), "sethostname")
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)


def drop_capabilities() -> None:
    """Drop every capability: bounding, ambient, effective, permitted and inheritable sets."""
    for cap in range(CAP_LAST_CAP + 1):
        if _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            if ctypes.get_errno() in (errno.EINVAL, errno.EPERM):
                break  # past the last capability, or no CAP_SETPCAP: nothing left to drop there
            _check(-1, f"prctl(PR_CAPBSET_DROP, {cap})")
    _libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)  # EINVAL on kernels without ambient caps
    header = ctypes.create_string_buffer(struct.pack("=Ii", LINUX_CAPABILITY_VERSION_3, 0))
    data = ctypes.create_string_buffer(bytes(24))  # two {effective, permitted, inheritable} u32 triples
    _check(_libc.capset(header, data), "capset(drop all)")


def apply_rlimits(limits: Limits, *, open_files: bool = True) -> None:
    """Apply the request's rlimits (soft = hard, so the program cannot raise them back).

    ``open_files=False`` leaves ``RLIMIT_NOFILE`` as it is: pid 1 of a jail, which passes the request's
    channels to its waiter (SCM_RIGHTS), keeps the zygote's (``raise_open_files``). The kernel refuses
    such a pass (ETOOMANYREFS) from a process without ``CAP_SYS_RESOURCE`` in the host's namespace,
    which no jail has, while its user has more fds in flight than the sender's ``RLIMIT_NOFILE``; and
    every jail runs as the one sandbox uid, whose programs can put fds in flight and keep them there
    (a socket that holds its own fd outlives its process until the kernel's collector finds it).
    Only the waiter, which passes nothing, takes the request's limit.
    """
    cpu = max(1, limits.cpu_seconds)
    # The hard CPU limit one second later turns an ignored SIGXCPU into a SIGKILL.
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
    resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes, limits.processes))
    if open_files:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limits.open_files, limits.open_files))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_size_bytes, limits.file_size_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (0, 0))


def raise_open_files() -> None:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard one (see ``apply_rlimits``)."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def load_seccomp(program: bytes) -> None:
    """Install a compiled seccomp BPF program (``no_new_privs`` must already be set)."""
    count = len(program) // 8
    if count == 0 or len(program) % 8:
        raise JailError(f"seccomp program of {len(program)} bytes is not a whole number of instructions")
    buffer = ctypes.create_string_buffer(program, len(program))

    class SockFprog(ctypes.Structure):
        _fields_ = (("len", ctypes.c_ushort), ("filter", ctypes.c_void_p))

    fprog = SockFprog(count, ctypes.addressof(buffer))
    _check(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(fprog), 0, 0), "load seccomp filter")


def reset_signals() -> None:
    """Default dispositions for every catchable signal (the zygote's handlers must not leak in)."""
    for sig in signal.valid_signals():
        # The interpreter's table knows every disposition it or the zygote set or inherited; only
        # those need a syscall (None: a signal the C library keeps for itself).
        if sig in (signal.SIGKILL, signal.SIGSTOP) or signal.getsignal(sig) in (signal.SIG_DFL, None):
            continue
        with contextlib.suppress(OSError, ValueError):
            signal.signal(sig, signal.SIG_DFL)
    signal.set_wakeup_fd(-1)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


def keep_fds(fds: list[int]) -> None:
    """Renumber ``fds`` to 0, 1, 2, … in order and close every other descriptor."""
    # Move them out of the way first so that dup2 onto 0..n-1 never clobbers one still needed.
    high = [os.dup(fd) for fd in fds]
    for target, fd in enumerate(high):
        os.dup2(fd, target, inheritable=True)
    os.closerange(len(fds), 1 << 20)
