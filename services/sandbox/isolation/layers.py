"""Which isolation layers this host offers, and the refusal to start without them.

Layers (each one is a separate line of defence; see ``docs/sandbox-isolation.md``):

- ``python``: the zygote's interpreter (a system Python 3.11+ readable by the sandbox uid). Required.
- ``setpriv``: switching to the sandbox's non-root uid/gid with no supplementary groups.
- ``bwrap``: bubblewrap's outer namespaces: no network, a read-only view of ``/usr`` and the staged
  sources only, no host environment.
- ``userns``: unprivileged user namespaces, for the per-request namespaces and private tmpfs.
- ``seccomp``: the syscall filter (Debian's ``python3-seccomp`` module).
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from services.sandbox.isolation.settings import IsolationSettings

LAYERS: tuple[str, ...] = ("python", "setpriv", "bwrap", "userns", "seccomp")
_PROBE_TIMEOUT_S = 10.0
_USERNS_PROBE = (
    "import ctypes,sys; libc=ctypes.CDLL(None, use_errno=True); "
    "sys.exit(0 if libc.unshare(0x10000000) == 0 else ctypes.get_errno() or 1)"
)


@dataclass(frozen=True)
class LayerStatus:
    """One layer's probe result.

    Attributes:
        available: whether the layer works on this host with this configuration.
        detail: what was found (version, path) or why it is missing and how to fix it.
    """

    available: bool
    detail: str

    def to_dict(self) -> dict[str, object]:
        return {"available": self.available, "detail": self.detail}


class SandboxUnavailable(RuntimeError):
    """Required isolation layers are missing; the message names each one and the fix.

    Attributes:
        missing: the missing layers that configuration does not allow to be missing.
    """

    def __init__(self, missing: dict[str, LayerStatus]) -> None:
        self.missing = missing
        names = ", ".join(f"{name} ({status.detail})" for name, status in missing.items())
        degradable = [n for n in missing if n != "python"]
        fix = "install the missing layers (scripts/setup.sh)"
        if degradable:
            allow = ",".join(f'"{n}"' for n in degradable)
            fix += f", or accept running without them: SPADE_SANDBOX_ISOLATION__ALLOW_DEGRADED='[{allow}]'"
        super().__init__(f"sandbox refuses to start: missing isolation layers: {names}; {fix}")


def _run(argv: list[str]) -> tuple[int, str]:
    try:
        done = subprocess.run(
            argv, capture_output=True, timeout=_PROBE_TIMEOUT_S, check=False, env={}, cwd="/", stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return -1, str(exc)
    text = (done.stdout + done.stderr).decode("utf-8", "replace").strip()
    return done.returncode, text[-300:]


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def _probe_python(settings: IsolationSettings) -> LayerStatus:
    if not _executable(settings.python):
        return LayerStatus(False, f"{settings.python} is not an executable file; install python3.11")
    code, out = _run([str(settings.python), "-I", "-S", "-c", "import sys; print('%d.%d' % sys.version_info[:2])"])
    if code != 0:
        return LayerStatus(False, f"{settings.python} does not run: {out}")
    major, minor = (int(x) for x in out.split(".")[:2])
    if (major, minor) < (3, 11):
        return LayerStatus(False, f"{settings.python} is Python {out}; 3.11 or newer is needed")
    return LayerStatus(True, f"{settings.python} (Python {out})")


def _probe_setpriv(settings: IsolationSettings) -> LayerStatus:
    if not _executable(settings.setpriv):
        return LayerStatus(False, f"{settings.setpriv} not found; install util-linux")
    euid = os.geteuid()
    if euid not in (0, settings.uid):
        return LayerStatus(False, f"the service runs as uid {euid}, not root: it cannot switch to uid {settings.uid}")
    return LayerStatus(True, f"{settings.setpriv}: runs code as uid {settings.uid}, gid {settings.gid}")


def _as_sandbox_user(settings: IsolationSettings, setpriv_ok: bool) -> list[str]:
    if not setpriv_ok:
        return []
    return [
        str(settings.setpriv),
        f"--reuid={settings.uid}",
        f"--regid={settings.gid}",
        "--clear-groups",
        "--",
    ]


def _probe_userns(settings: IsolationSettings, setpriv_ok: bool) -> LayerStatus:
    for knob, bad in (("/proc/sys/user/max_user_namespaces", "0"), ("/proc/sys/kernel/unprivileged_userns_clone", "0")):
        try:
            if Path(knob).read_text().strip() == bad:
                return LayerStatus(False, f"{knob} is {bad}: user namespaces are disabled on this host")
        except OSError:
            pass
    if not _executable(settings.python):
        return LayerStatus(False, "cannot probe without the python layer")
    code, out = _run([*_as_sandbox_user(settings, setpriv_ok), str(settings.python), "-I", "-S", "-c", _USERNS_PROBE])
    if code != 0:
        return LayerStatus(False, f"unshare(CLONE_NEWUSER) as the sandbox uid failed (errno {code}) {out}".strip())
    return LayerStatus(True, "unprivileged user namespaces work")


def _probe_bwrap(settings: IsolationSettings, setpriv_ok: bool) -> LayerStatus:
    if not _executable(settings.bwrap):
        return LayerStatus(False, f"{settings.bwrap} not found; install bubblewrap")
    code, out = _run([*_as_sandbox_user(settings, setpriv_ok), str(settings.bwrap), "--unshare-all", "--ro-bind",
                      "/usr", "/usr", "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib",
                      "--symlink", "usr/lib64", "/lib64", "/usr/bin/true"])  # fmt: skip
    if code != 0:
        return LayerStatus(False, f"{settings.bwrap} cannot create namespaces here: {out or code}")
    _, version = _run([str(settings.bwrap), "--version"])
    return LayerStatus(True, version or str(settings.bwrap))


def _probe_seccomp(settings: IsolationSettings) -> LayerStatus:
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        status = ""
    if "Seccomp:" not in status:
        return LayerStatus(False, "the kernel does not support seccomp filters")
    if not _executable(settings.python):
        return LayerStatus(False, "cannot probe without the python layer")
    probe = f"import sys; sys.path.append({str(settings.seccomp_path)!r}); import seccomp; print(seccomp.get_api())"
    code, out = _run([str(settings.python), "-I", "-S", "-c", probe])
    if code != 0:
        return LayerStatus(
            False, f"python3-seccomp is not importable from {settings.seccomp_path}; apt-get install python3-seccomp"
        )
    return LayerStatus(True, f"libseccomp API level {out}")


def probe_layers(settings: IsolationSettings | None = None) -> dict[str, LayerStatus]:
    """Probe every layer on this host (blocking; a few short subprocesses).

    Returns:
        layer name → ``LayerStatus``, for every name in ``LAYERS``.
    """
    settings = settings or IsolationSettings()
    setpriv = _probe_setpriv(settings)
    return {
        "python": _probe_python(settings),
        "setpriv": setpriv,
        "bwrap": _probe_bwrap(settings, setpriv.available),
        "userns": _probe_userns(settings, setpriv.available),
        "seccomp": _probe_seccomp(settings),
    }


def require_layers(settings: IsolationSettings, layers: dict[str, LayerStatus]) -> list[str]:
    """Raise ``SandboxUnavailable`` unless every missing layer is allowed; return the degraded ones."""
    missing = {name: status for name, status in layers.items() if not status.available}
    refused = {name: status for name, status in missing.items() if name not in settings.allow_degraded}
    if refused:
        raise SandboxUnavailable(refused)
    return sorted(missing)
