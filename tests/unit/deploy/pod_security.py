"""Pod Security Standards, checked offline: what the API server's Pod Security admission enforces.

The rules of the ``baseline`` and ``restricted`` levels as Kubernetes 1.33 defines them
(https://kubernetes.io/docs/concepts/security/pod-security-standards/), including the relaxation
for user-namespaced pods (``hostUsers: false``): ``runAsNonRoot``/``runAsUser`` are not checked at
either level, and ``procMount`` is not checked at ``baseline``. Each finding names the field.
"""

from __future__ import annotations

from typing import Any

BASELINE_CAPABILITIES = frozenset(
    {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE",
     "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
)  # fmt: skip
SAFE_SYSCTLS = frozenset(
    {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
     "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
     "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
     "net.ipv4.tcp_keepalive_probes"}
)  # fmt: skip
SELINUX_TYPES = frozenset({"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"})
RESTRICTED_VOLUMES = frozenset(
    {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret"}
)
LEVELS = ("privileged", "baseline", "restricted")


def _containers(pod: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for field in ("initContainers", "containers", "ephemeralContainers"):
        out += [(f"{field}[{c.get('name')}]", c) for c in pod.get(field) or []]
    return out


def _baseline(pod: dict[str, Any], annotations: dict[str, str]) -> list[str]:
    found: list[str] = []
    userns = pod.get("hostUsers") is False
    pod_sc = pod.get("securityContext") or {}
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(field):
            found.append(f"spec.{field} is true")
    if (pod_sc.get("windowsOptions") or {}).get("hostProcess"):
        found.append("spec.securityContext.windowsOptions.hostProcess is true")
    for vol in pod.get("volumes") or []:
        if "hostPath" in vol:
            found.append(f"volume {vol['name']} is a hostPath")
    for key, value in annotations.items():
        if key.startswith("container.apparmor.security.beta.kubernetes.io/") and value == "unconfined":
            found.append(f"annotation {key} is unconfined")
    for where, sc in [("spec.securityContext", pod_sc)] + [
        (f"{name}.securityContext", c.get("securityContext") or {}) for name, c in _containers(pod)
    ]:
        if (sc.get("seccompProfile") or {}).get("type") == "Unconfined":
            found.append(f"{where}.seccompProfile is Unconfined")
        if (sc.get("appArmorProfile") or {}).get("type") == "Unconfined":
            found.append(f"{where}.appArmorProfile is Unconfined")
        selinux = sc.get("seLinuxOptions") or {}
        if selinux.get("type", "") not in SELINUX_TYPES or selinux.get("user") or selinux.get("role"):
            found.append(f"{where}.seLinuxOptions {selinux} not allowed")
    for sysctl in pod_sc.get("sysctls") or []:
        if sysctl["name"] not in SAFE_SYSCTLS:
            found.append(f"sysctl {sysctl['name']} is not a safe sysctl")
    for name, c in _containers(pod):
        sc = c.get("securityContext") or {}
        if sc.get("privileged"):
            found.append(f"{name} is privileged")
        added = set((sc.get("capabilities") or {}).get("add") or [])
        if added - BASELINE_CAPABILITIES:
            found.append(f"{name} adds capabilities {sorted(added - BASELINE_CAPABILITIES)}")
        if sc.get("procMount", "Default") != "Default" and not userns:
            found.append(f"{name}.securityContext.procMount is {sc['procMount']} without hostUsers: false")
        for port in c.get("ports") or []:
            if port.get("hostPort"):
                found.append(f"{name} uses hostPort {port['hostPort']}")
    return found


def _restricted(pod: dict[str, Any]) -> list[str]:
    found: list[str] = []
    userns = pod.get("hostUsers") is False
    pod_sc = pod.get("securityContext") or {}
    for vol in pod.get("volumes") or []:
        kinds = set(vol) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            found.append(
                f"volume {vol['name']} has type {sorted(kinds)} (restricted allows {sorted(RESTRICTED_VOLUMES)})"
            )
    for name, c in _containers(pod):
        sc = c.get("securityContext") or {}
        if sc.get("allowPrivilegeEscalation") is not False:
            found.append(f"{name}.securityContext.allowPrivilegeEscalation must be false")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            found.append(f"{name}.securityContext.capabilities.drop must contain ALL")
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            found.append(f"{name} adds capabilities {sorted(caps['add'])} (restricted allows NET_BIND_SERVICE)")
        if sc.get("procMount", "Default") != "Default":
            found.append(f"{name}.securityContext.procMount must be Default")
        seccomp = (sc.get("seccompProfile") or pod_sc.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            found.append(f"{name}: seccompProfile must be RuntimeDefault or Localhost (pod or container)")
        if not userns:
            non_root = sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot"))
            if non_root is not True:
                found.append(f"{name}: runAsNonRoot must be true (pod or container)")
            if sc.get("runAsUser", pod_sc.get("runAsUser")) == 0:
                found.append(f"{name}: runAsUser must not be 0")
    return found


def violations(pod: dict[str, Any], level: str, annotations: dict[str, str] | None = None) -> list[str]:
    """What in ``pod`` (a PodSpec) breaks Pod Security ``level``; empty when it complies."""
    if level not in LEVELS:
        raise ValueError(f"unknown Pod Security level {level!r}; one of {LEVELS}")
    if level == "privileged":
        return []
    found = _baseline(pod, annotations or {})
    if level == "restricted":
        found += _restricted(pod)
    return found
