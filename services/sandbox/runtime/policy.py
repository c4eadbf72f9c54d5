"""The seccomp policy of untrusted code, compiled once by the zygote into a BPF program.

Default allow; the syscalls below fail with EPERM (``clone3`` with ENOSYS, so libc falls back to
``clone``, whose flags a BPF filter can inspect). Other architectures' syscall ABIs (i386, x32) are
killed by libseccomp's architecture check. Needs Debian's ``seccomp`` module (python3-seccomp).
"""

from __future__ import annotations

import contextlib
import errno
import socket
import sys
import tempfile

DENIED = (
    # Debugging and reading other processes' memory.
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "kcmp",
    "pidfd_getfd",
    # Filesystems and namespaces.
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "unshare",
    "setns",
    "open_tree",
    "move_mount",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "mount_setattr",
    "open_by_handle_at",
    "name_to_handle_at",
    # Kernel attack surface.
    "bpf",
    "keyctl",
    "add_key",
    "request_key",
    "perf_event_open",
    "userfaultfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "lookup_dcookie",
    "syslog",
    "iopl",
    "ioperm",
    "uselib",
    "vhangup",
    # Host administration.
    "reboot",
    "swapon",
    "swapoff",
    "acct",
    "quotactl",
    "quotactl_fd",
    "sethostname",
    "setdomainname",
    "settimeofday",
    "clock_settime",
    "clock_adjtime",
    "adjtimex",
)

CLONE_NAMESPACE_FLAGS = (
    0x00000080,  # CLONE_NEWTIME
    0x00020000,  # CLONE_NEWNS
    0x02000000,  # CLONE_NEWCGROUP
    0x04000000,  # CLONE_NEWUTS
    0x08000000,  # CLONE_NEWIPC
    0x10000000,  # CLONE_NEWUSER
    0x20000000,  # CLONE_NEWPID
    0x40000000,  # CLONE_NEWNET
)
PERSONALITY_FLAGS = (
    0x0040000,  # ADDR_NO_RANDOMIZE
    0x0100000,  # MMAP_PAGE_ZERO
    0x0200000,  # ADDR_COMPAT_LAYOUT
    0x0400000,  # READ_IMPLIES_EXEC
    0x0800000,  # ADDR_LIMIT_32BIT
    0x8000000,  # ADDR_LIMIT_3GB
)
TIOCSTI = 0x5412  # push bytes into a terminal's input queue
TIOCLINUX = 0x541C


def _load_module(seccomp_path: str) -> object:
    if seccomp_path not in sys.path:
        sys.path.append(seccomp_path)
    import seccomp

    return seccomp


def build_program(seccomp_path: str) -> bytes:
    """Compile the policy; returns the raw BPF instructions the kernel loads.

    Raises:
        ImportError: when the ``seccomp`` module is not installed under ``seccomp_path``.
    """
    sc = _load_module(seccomp_path)
    flt = sc.SyscallFilter(defaction=sc.ALLOW)  # type: ignore[attr-defined]
    eperm = sc.ERRNO(errno.EPERM)  # type: ignore[attr-defined]
    for name in DENIED:
        # A syscall this architecture does not have cannot be called either.
        with contextlib.suppress(RuntimeError, ValueError):
            flt.add_rule(eperm, name)
    flt.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")  # type: ignore[attr-defined]
    for flag in CLONE_NAMESPACE_FLAGS:
        flt.add_rule(eperm, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))  # type: ignore[attr-defined]
    for call in ("socket", "socketpair"):
        flt.add_rule(eperm, call, sc.Arg(0, sc.NE, socket.AF_UNIX))  # type: ignore[attr-defined]
    # Personality flags that switch off ASLR, map page zero or make data executable (the query
    # 0xffffffff sets every bit, so it is refused too: nothing in CPython or glibc asks it).
    for flag in PERSONALITY_FLAGS:
        flt.add_rule(eperm, "personality", sc.Arg(0, sc.MASKED_EQ, flag, flag))  # type: ignore[attr-defined]
    for request in (TIOCSTI, TIOCLINUX):
        flt.add_rule(eperm, "ioctl", sc.Arg(1, sc.EQ, request))  # type: ignore[attr-defined]
    with tempfile.TemporaryFile() as out:
        flt.export_bpf(out)
        out.flush()
        out.seek(0)
        program = out.read()
    if not program or len(program) % 8:
        raise RuntimeError(f"libseccomp exported {len(program)} bytes, not a BPF program")
    return program
