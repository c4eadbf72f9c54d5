"""The escape suite: every attack is really attempted from untrusted code through ``SandboxPool.execute``.

Each test checks three things: the attack failed (the secret, the host or the network stayed out of
reach), the execution got the right status, and the pool still serves a normal execution afterwards
without having had to restart its zygote.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import textwrap
from pathlib import Path

import pytest

from services.sandbox.isolation import ExecLimits, ExecStatus, SandboxPool
from tests.security.conftest import SANDBOX_UID, SECRET, descendants, sandbox_pids

pytestmark = pytest.mark.asyncio(loop_scope="session")

PROBE = textwrap.dedent(
    """
    import json, os
    results = {}
    def attempt(name, fn):
        try:
            results[name] = "ok: " + repr(fn())[:300]
        except BaseException as exc:
            results[name] = type(exc).__name__ + ": " + str(exc)[:200]
    """
)
REPORT = "\nprint(json.dumps(results))\n"


async def probe(pool: SandboxPool, body: str, **kwargs: object):
    """Run PROBE + body; return (result, {attempt: outcome})."""
    result = await pool.execute(PROBE + textwrap.dedent(body) + REPORT, **kwargs)  # type: ignore[arg-type]
    assert SECRET not in (result.stdout + result.stderr).decode("utf-8", "replace")
    lines = result.stdout.decode().strip().splitlines()
    assert lines, f"probe printed nothing: {result}"
    return result, json.loads(lines[-1])


async def assert_healthy(pool: SandboxPool) -> None:
    """A normal execution still works and no zygote had to restart."""
    result = await pool.execute("import sys; print(sum(range(10)), file=sys.stdout)")
    assert (result.status, result.stdout) == (ExecStatus.OK, b"45\n")
    health = pool.health()
    assert health["status"] == "ok"
    assert all(z["alive"] and z["restarts"] == 0 for z in health["zygotes"]), health


def denied(outcome: str) -> bool:
    return not outcome.startswith("ok")


async def test_planted_host_files_and_checkout_are_invisible(pool: SandboxPool, planted: dict[str, Path]) -> None:
    checkout = Path(__file__).resolve().parents[2]
    result, seen = await probe(
        pool,
        f"""
        attempt("tmp_secret", lambda: open({str(planted["tmp"])!r}).read())
        attempt("root_secret", lambda: open({str(planted["root"])!r}).read())
        attempt("root_dir", lambda: os.listdir("/root"))
        attempt("checkout", lambda: open({str(checkout / "pyproject.toml")!r}).read())
        attempt("checkout_dir", lambda: os.listdir({str(checkout)!r}))
        attempt("etc_passwd", lambda: open("/etc/passwd").read())
        attempt("etc_shadow", lambda: open("/etc/shadow").read())
        attempt("home", lambda: os.listdir("/home"))
        attempt("venv", lambda: os.listdir({str(checkout / ".venv")!r}))
        attempt("root_listing", lambda: sorted(os.listdir("/")))
        """,
    )
    assert result.status is ExecStatus.OK
    for name in (
        "tmp_secret",
        "root_secret",
        "root_dir",
        "checkout",
        "checkout_dir",
        "etc_passwd",
        "etc_shadow",
        "home",
        "venv",
    ):
        assert seen[name].startswith(("FileNotFoundError", "PermissionError")), (name, seen[name])
    # Only the runtime's read-only view: /usr (+ its symlinks), the staged sources, /proc, /dev, /tmp.
    listing = eval(seen["root_listing"][4:])
    assert set(listing) <= {"bin", "dev", "lib", "lib64", "opt", "proc", "tmp", "usr"}, listing
    await assert_healthy(pool)


async def test_service_environment_is_invisible(pool: SandboxPool) -> None:
    assert os.environ["SPADE_ESCAPE_SECRET"] == SECRET
    result, seen = await probe(
        pool,
        """
        attempt("environ", lambda: dict(os.environ))
        attempt("self_environ", lambda: open("/proc/self/environ", "rb").read())
        attempt("init_environ", lambda: open("/proc/1/environ", "rb").read())
        attempt("parent_environ", lambda: open(f"/proc/{os.getppid()}/environ", "rb").read())
        attempt("init_cmdline", lambda: open("/proc/1/cmdline", "rb").read())
        """,
    )
    assert result.status is ExecStatus.OK
    assert "SPADE" not in seen["environ"] and "VIRTUAL_ENV" not in seen["environ"]
    expected = {"HOME": "/tmp", "TMPDIR": "/tmp", "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
    assert seen["environ"] == "ok: " + repr(expected)[:300]  # the whole environment, set by the zygote
    assert denied(seen["init_environ"]), seen["init_environ"]
    await assert_healthy(pool)


async def test_writes_outside_the_private_tmpfs_fail(pool: SandboxPool) -> None:
    result, seen = await probe(
        pool,
        """
        for path in ("/usr/evil", "/opt/spade/evil", "/evil", "/dev/evil", "/proc/evil", "/bin/evil", "/dev/shm/evil"):
            attempt(path, lambda path=path: open(path, "w").write("x"))
        attempt("/tmp/ok", lambda: open("/tmp/ok", "w").write("x"))
        attempt("cwd", lambda: os.getcwd())
        attempt("sysrq", lambda: open("/proc/sysrq-trigger", "w").write("b"))
        attempt("core_pattern", lambda: open("/proc/sys/kernel/core_pattern", "w").write("|/tmp/x"))
        """,
    )
    assert result.status is ExecStatus.OK
    for path in ("/usr/evil", "/opt/spade/evil", "/evil", "/dev/evil", "/proc/evil", "/bin/evil", "/dev/shm/evil"):
        assert denied(seen[path]), (path, seen[path])
    assert denied(seen["sysrq"]) and denied(seen["core_pattern"])
    assert seen["/tmp/ok"] == "ok: 1" and seen["cwd"] == "ok: '/tmp'"
    assert not Path("/usr/evil").exists() and not Path("/evil").exists()
    await assert_healthy(pool)


async def test_tmpfs_is_private_per_execution(pool: SandboxPool) -> None:
    writer = "import os, time\nopen('/tmp/mine', 'w').write('a')\nprint(sorted(os.listdir('/tmp')))\ntime.sleep(1)"
    reader = "import os, time\ntime.sleep(0.3)\nprint(sorted(os.listdir('/tmp')))"
    first, second = await asyncio.gather(pool.execute(writer), pool.execute(reader))
    assert b"mine" in first.stdout
    assert second.stdout == b"[]\n", second
    again = await pool.execute("import os; print(os.listdir('/tmp'))")
    assert again.stdout == b"[]\n"


async def test_abstract_unix_sockets_do_not_reach_another_execution(pool: SandboxPool) -> None:
    # Abstract AF_UNIX names (the only socket family seccomp allows) live in a network namespace:
    # every jail has its own, so two tenants running at once cannot meet through one.
    name = "spade-abstract-" + SECRET[-6:]
    server = textwrap.dedent(
        f"""
        import socket, time
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind("\\0{name}")
        s.listen(1)
        print("listening", flush=True)
        s.settimeout(1.5)
        try:
            s.accept()
            print("accepted")
        except TimeoutError:
            print("nobody came")
        """
    )
    client = textwrap.dedent(
        f"""
        import socket, time
        time.sleep(0.4)
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            c.connect("\\0{name}")
            print("connected")
        except OSError as exc:
            print(type(exc).__name__)
        """
    )
    listening, connecting = await asyncio.gather(pool.execute(server), pool.execute(client))
    assert listening.stdout == b"listening\nnobody came\n", listening
    assert connecting.stdout == b"ConnectionRefusedError\n", connecting
    await assert_healthy(pool)


async def test_a_jail_is_pid_1_and_one_child_right_below_the_zygote(pool: SandboxPool) -> None:
    # The process model: the zygote clones each jail's pid 1 straight into its namespaces (no
    # process in between), and pid 1 forks the one process that runs the program (or waits to).
    launched = pool.health()["zygotes"][0]["pid"]
    zygote = next(
        pid for pid in descendants(launched) if _comm(pid) == "python3.11" and _comm(_parent(pid)) != "python3.11"
    )
    running = asyncio.create_task(pool.execute("import time; print('up', flush=True); time.sleep(1.2)"))
    await asyncio.sleep(0.6)
    below = descendants(zygote)
    parents = {pid: _parent(pid) for pid in below}
    jails = {pid for pid in below if parents[pid] == zygote}
    children = {jail: [pid for pid in below if parents[pid] == jail] for jail in jails}
    assert len(jails) >= 2 and all(len(kids) == 1 for kids in children.values()), parents  # a spare and the request
    assert below == jails | {kid for kids in children.values() for kid in kids}, parents
    assert (await running).stdout == b"up\n"


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


async def test_loopback_services_are_unreachable(pool: SandboxPool) -> None:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    try:
        result, seen = await probe(
            pool,
            f"""
            import socket
            def connect(port, family=socket.AF_INET, host="127.0.0.1"):
                s = socket.socket(family, socket.SOCK_STREAM)
                s.settimeout(1)
                s.connect((host, port))
                return s.getpeername()
            attempt("postgres", lambda: connect(5432))
            attempt("redis", lambda: connect(6379))
            attempt("listener", lambda: connect({port}))
            attempt("ipv6", lambda: connect({port}, socket.AF_INET6, "::1"))
            attempt("udp", lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
            attempt("netlink", lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0))
            attempt("packet", lambda: socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0))
            attempt("unix_ok", lambda: socket.socketpair()[0].family)
            attempt("host_docker_sock", lambda: socket.socket(socket.AF_UNIX).connect("/var/run/docker.sock"))
            """,
        )
        with pytest.raises(BlockingIOError):
            listener.accept()
    finally:
        listener.close()
    assert result.status is ExecStatus.OK
    for name in ("postgres", "redis", "listener", "ipv6", "udp", "netlink", "packet"):
        assert seen[name].startswith("PermissionError"), (name, seen[name])
    assert seen["unix_ok"].startswith("ok")
    assert denied(seen["host_docker_sock"])
    await assert_healthy(pool)


async def test_fork_bomb_is_contained(pool: SandboxPool) -> None:
    result = await pool.execute(
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
        timeout_s=2.0,
    )
    assert result.status is ExecStatus.TIMEOUT
    await assert_healthy(pool)


async def test_memory_bomb_hits_the_memory_limit(pool: SandboxPool) -> None:
    result = await pool.execute("blocks = []\nwhile True:\n    blocks.append(bytearray(16 << 20))\n", memory_mb=128)
    assert result.status is ExecStatus.MEMORY_LIMIT, result
    assert result.exit_code == 1 and b"MemoryError" in result.stderr
    await assert_healthy(pool)


async def test_busy_loop_hits_the_wall_clock(pool: SandboxPool) -> None:
    result = await pool.execute("while True:\n    pass\n", timeout_s=1.0)
    assert result.status is ExecStatus.TIMEOUT
    await assert_healthy(pool)


async def test_busy_loop_hits_the_cpu_limit_even_if_the_wall_clock_allows(pool: SandboxPool) -> None:
    result = await pool.execute(
        "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass\n",
        limits=ExecLimits(timeout_s=20.0, cpu_s=1.0),
    )
    assert result.status is ExecStatus.CPU_LIMIT
    assert result.exit_code == -9  # SIGXCPU ignored, so the hard limit's SIGKILL ended it
    await assert_healthy(pool)


async def test_sleeping_program_is_killed_at_the_wall_clock(pool: SandboxPool) -> None:
    result = await pool.execute("import time\nprint('started', flush=True)\ntime.sleep(60)\n", timeout_s=0.5)
    assert result.status is ExecStatus.TIMEOUT and result.stdout == b"started\n"
    await assert_healthy(pool)


async def test_huge_output_is_capped(pool: SandboxPool) -> None:
    cap = pool.settings.stdout_bytes
    result = await pool.execute(
        "import sys\nprint('before', file=sys.stderr, flush=True)\nwhile True:\n    sys.stdout.write('x' * 65536)\n"
    )
    assert result.status is ExecStatus.OUTPUT_LIMIT
    assert len(result.stdout) == cap
    assert result.stderr == b"before\n"  # the other stream is kept whole
    err = await pool.execute("import sys\nwhile True:\n    sys.stderr.write('y' * 65536)\n")
    assert err.status is ExecStatus.OUTPUT_LIMIT and len(err.stderr) == pool.settings.stderr_bytes
    await assert_healthy(pool)


async def test_huge_file_hits_the_file_size_limit(pool: SandboxPool) -> None:
    limit = pool.settings.file_size_mb << 20
    result = await pool.execute(f"open('/tmp/big', 'wb').write(b'x' * {limit + (1 << 20)})")
    assert result.status is ExecStatus.OUTPUT_LIMIT, result
    await assert_healthy(pool)


async def test_signalling_the_parent_and_everyone_is_contained(pool: SandboxPool) -> None:
    zygote_host_pid = pool.health()["zygotes"][0]["pid"]
    result, seen = await probe(
        pool,
        f"""
        import signal
        attempt("ppid", lambda: os.getppid())
        attempt("kill_parent", lambda: os.kill(os.getppid(), signal.SIGKILL))
        attempt("kill_init", lambda: os.kill(1, signal.SIGKILL))
        attempt("kill_all", lambda: os.kill(-1, signal.SIGKILL))
        attempt("kill_zygote", lambda: os.kill({zygote_host_pid}, signal.SIGKILL))
        attempt("kill_service", lambda: os.kill({os.getpid()}, signal.SIGKILL))
        attempt("pids", lambda: sorted(int(p) for p in os.listdir("/proc") if p.isdigit()))
        """,
    )
    # The parent is pid 1 of the request's own pid namespace: it ignores signals from inside, and
    # reports normally; the service, the zygote and other requests are not even visible.
    assert result.status is ExecStatus.OK, result
    assert seen["ppid"] == "ok: 1"
    assert seen["pids"] == "ok: [1, 2]", seen["pids"]
    assert seen["kill_zygote"].startswith(("ProcessLookupError", "PermissionError")), seen["kill_zygote"]
    assert seen["kill_service"].startswith(("ProcessLookupError", "PermissionError")), seen["kill_service"]
    await assert_healthy(pool)


async def test_namespace_and_mount_syscalls_are_denied(pool: SandboxPool) -> None:
    result, seen = await probe(
        pool,
        """
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        def call(fn, *args):
            rc = fn(*args)
            return (rc, os.strerror(ctypes.get_errno())) if rc == -1 else (rc, "succeeded")
        attempt("unshare_user", lambda: call(libc.unshare, 0x10000000))
        attempt("unshare_mount", lambda: call(libc.unshare, 0x00020000))
        attempt("unshare_net", lambda: call(libc.unshare, 0x40000000))
        attempt("mount_tmpfs", lambda: call(libc.mount, b"none", b"/tmp", b"tmpfs", 0, None))
        attempt("mount_proc", lambda: call(libc.mount, b"proc", b"/tmp", b"proc", 0, None))
        attempt("remount_usr", lambda: call(libc.mount, None, b"/usr", None, 32 | 4096, None))
        attempt("umount", lambda: call(libc.umount2, b"/proc", 2))
        attempt("chroot", lambda: call(libc.chroot, b"/tmp"))
        fd = os.open("/proc/self/ns/user", os.O_RDONLY)
        attempt("setns", lambda: call(libc.setns, fd, 0))
        attempt("clone_newuser", lambda: call(libc.syscall, 56, 0x10000000 | 17, 0, 0, 0, 0))
        attempt("clone3", lambda: call(libc.syscall, 435, 0, 0))
        attempt("bpf", lambda: call(libc.syscall, 321, 0, 0, 0))
        attempt("keyctl", lambda: call(libc.syscall, 250, 0, 0, 0))
        attempt("perf_event_open", lambda: call(libc.syscall, 298, 0, 0, -1, -1, 0))
        attempt("userfaultfd", lambda: call(libc.syscall, 323, 0))
        attempt("io_uring_setup", lambda: call(libc.syscall, 425, 8, 0))
        attempt("personality", lambda: call(libc.personality, 0x0040000))
        attempt("ptrace_attach", lambda: call(libc.ptrace, 16, 1, 0, 0))
        attempt("ptrace_traceme", lambda: call(libc.ptrace, 0, 0, 0, 0))
        wanted = ("CapEff", "CapPrm", "CapBnd", "NoNewPrivs", "Seccomp:")
        attempt("capabilities", lambda: [l for l in open("/proc/self/status") if l.startswith(wanted)])
        attempt("uid", lambda: (os.getuid(), os.geteuid(), os.getgid(), os.getgroups()))
        attempt("setuid_root", lambda: os.setuid(0))
        """,
    )
    assert result.status is ExecStatus.OK, result
    for name in (
        "unshare_user", "unshare_mount", "unshare_net", "mount_tmpfs", "mount_proc", "remount_usr", "umount",
        "chroot", "setns", "clone_newuser", "bpf", "keyctl", "perf_event_open", "userfaultfd",
        "io_uring_setup", "personality", "ptrace_attach", "ptrace_traceme",
    ):  # fmt: skip
        assert "Operation not permitted" in seen[name], (name, seen[name])
    assert "Function not implemented" in seen["clone3"]
    caps = seen["capabilities"]
    for field in ("CapEff:\\t0000000000000000", "CapPrm:\\t0000000000000000", "CapBnd:\\t0000000000000000"):
        assert field in caps, caps
    assert "NoNewPrivs:\\t1" in caps and "Seccomp:\\t2" in caps
    assert seen["uid"] == f"ok: ({SANDBOX_UID}, {SANDBOX_UID}, {SANDBOX_UID}, [])"
    assert seen["setuid_root"].startswith(("PermissionError", "OSError")), seen["setuid_root"]  # 0 is unmapped
    await assert_healthy(pool)


async def test_symlink_and_proc_root_tricks_fail(pool: SandboxPool, planted: dict[str, Path]) -> None:
    result, seen = await probe(
        pool,
        f"""
        os.symlink("/root", "/tmp/r")
        os.symlink({str(planted["tmp"])!r}, "/tmp/s")
        attempt("via_symlink_dir", lambda: os.listdir("/tmp/r"))
        attempt("via_symlink_file", lambda: open("/tmp/s").read())
        attempt("proc1_root", lambda: os.listdir("/proc/1/root/"))
        attempt("proc1_root_secret", lambda: open("/proc/1/root" + {str(planted["tmp"])!r}).read())
        attempt("proc1_cwd", lambda: os.listdir("/proc/1/cwd"))
        attempt("proc1_fd", lambda: os.readlink("/proc/1/fd/3"))
        attempt("proc1_fd_reopen", lambda: open("/proc/1/fd/3", "wb").write(b"M"))
        attempt("proc1_mem", lambda: open("/proc/1/mem", "rb").read(1))
        attempt("self_root", lambda: sorted(os.listdir("/proc/self/root/")))
        attempt("dotdot", lambda: os.listdir("/tmp/../../../../root"))
        attempt("opt_escape", lambda: os.listdir("/opt/spade/../../root"))
        """,
    )
    assert result.status is ExecStatus.OK, result
    for name in ("via_symlink_dir", "via_symlink_file", "proc1_root_secret", "dotdot", "opt_escape"):
        assert seen[name].startswith(("FileNotFoundError", "PermissionError")), (name, seen[name])
    # pid 1 (the request's trusted runner) is not dumpable: its fds, root and memory are off limits.
    for name in ("proc1_root", "proc1_cwd", "proc1_fd", "proc1_fd_reopen", "proc1_mem"):
        assert seen[name].startswith("PermissionError"), (name, seen[name])
    await assert_healthy(pool)


async def test_code_runs_as_the_unprivileged_host_uid(pool: SandboxPool) -> None:
    marker = "uid-probe-" + SECRET[-6:]
    task = asyncio.create_task(
        pool.execute(f"import time, sys\nsys.argv.append({marker!r})\nprint('up', flush=True)\ntime.sleep(1.5)")
    )
    await asyncio.sleep(0.8)
    owned = sandbox_pids()
    # Every process of the pool (zygote, holders, jails) belongs to the sandbox uid on the host.
    assert any(pool.instance and pool.instance in cmd for cmd in owned.values())
    result = await task
    assert result.status is ExecStatus.OK
    root_owned = [
        entry.name
        for entry in Path("/proc").iterdir()
        if entry.name.isdigit() and pool.instance and pool.instance in _cmdline(entry)
        and _real_uid(entry) == 0
    ]  # fmt: skip
    assert root_owned == []


def _cmdline(entry: Path) -> str:
    try:
        return (entry / "cmdline").read_bytes().decode("utf-8", "replace")
    except OSError:
        return ""


def _real_uid(entry: Path) -> int | None:
    try:
        for line in (entry / "status").read_text().splitlines():
            if line.startswith("Uid:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


async def test_hash_seed_is_fixed_across_zygotes(pool: SandboxPool) -> None:
    # Both regret arms may play in different zygotes (or replicas): str hashing, hence set and dict
    # iteration order and the instances an env builds from them, must not differ between them.
    from services.sandbox.isolation.settings import IsolationSettings

    code = "print(hash('spade'), list({'alpha', 'beta', 'gamma', 'delta', 'epsilon'}))"
    first = await pool.execute(code, b"", {})
    async with SandboxPool(IsolationSettings()) as other:
        second = await other.execute(code, b"", {})
    assert first.status == ExecStatus.OK and first.stdout == second.stdout
