"""Settings of the isolation layer: who runs untrusted code, with which layers and limits.

The service nests ``IsolationSettings`` in its own settings (``SPADE_SANDBOX_ISOLATION__*``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Layer = Literal["bwrap", "setpriv", "userns", "seccomp", "python"]
"""An isolation layer the pool probes at start (see ``services.sandbox.isolation.layers``)."""

DEGRADABLE: tuple[str, ...] = ("bwrap", "setpriv", "userns", "seccomp")
"""Layers that configuration may allow to be missing; without ``python`` nothing can run."""


class IsolationSettings(BaseModel):
    """Isolation layers, the sandbox identity, and default/maximum limits of untrusted code.

    Every limit has a default (used when a request does not ask) and, where a request may ask for
    more, a maximum. Memory is the address-space rlimit of each sandboxed process.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    uid: int = Field(
        default=65534, ge=1, le=2**31 - 2, description="Host uid untrusted code runs as (never 0; default nobody)."
    )
    gid: int = Field(default=65534, ge=1, le=2**31 - 2, description="Host gid untrusted code runs as (never 0).")
    python: Path = Field(
        default=Path("/usr/bin/python3.11"),
        description="Interpreter of the zygote: a system Python 3.11 readable by the sandbox uid "
        "(not the project's venv, which the sandbox must not see).",
    )
    bwrap: Path = Field(default=Path("/usr/bin/bwrap"), description="bubblewrap binary (the outer namespaces).")
    setpriv: Path = Field(default=Path("/usr/bin/setpriv"), description="setpriv binary (drops to `uid`/`gid`).")
    seccomp_path: Path = Field(
        default=Path("/usr/lib/python3/dist-packages"),
        description="Directory holding Debian's `seccomp` Python module (package python3-seccomp).",
    )
    zygotes: int = Field(
        default=1, ge=1, le=64, description="Pre-warmed zygote processes; requests are spread over them."
    )
    spares: int = Field(
        default=2,
        ge=1,
        le=64,
        description="Jails each zygote keeps built and locked down ahead of time, waiting for a request "
        "(their namespace set-up is then off the request's critical path).",
    )
    max_concurrency: int = Field(
        default=32, ge=1, le=10_000, description="Executions and validations running at once (others wait)."
    )
    allow_degraded: list[Layer] = Field(
        default_factory=list,
        description="Layers that may be missing: the pool then runs without them and says so in "
        "health(). Empty (the default) means every layer is required.",
    )

    cpu_seconds: float = Field(default=10.0, gt=0, le=3600, description="Default CPU-time rlimit per process (s).")
    max_cpu_seconds: float = Field(
        default=60.0, gt=0, le=3600, description="Largest CPU-time rlimit a request may get."
    )
    memory_mb: int = Field(default=512, ge=64, le=65536, description="Default address-space rlimit per process (MiB).")
    max_memory_mb: int = Field(
        default=2048, ge=64, le=65536, description="Largest address-space rlimit a request may ask."
    )
    processes: int = Field(
        default=32, ge=2, le=4096, description="Processes (and threads) one request may hold at once (RLIMIT_NPROC)."
    )
    open_files: int = Field(
        default=64, ge=16, le=65536, description="Open file descriptors per process (RLIMIT_NOFILE)."
    )
    file_size_mb: int = Field(
        default=16, ge=1, le=4096, description="Largest file a sandboxed process may write (MiB)."
    )
    tmpfs_mb: int = Field(default=64, ge=1, le=8192, description="Size of each request's private writable tmpfs (MiB).")
    wall_seconds: float = Field(
        default=10.0, gt=0, le=3600, description="Default wall-clock limit of an execution (s)."
    )
    max_wall_seconds: float = Field(
        default=60.0, gt=0, le=3600, description="Largest wall-clock limit a request may ask."
    )
    validate_wall_seconds: float = Field(
        default=60.0, gt=0, le=3600, description="Wall-clock limit of a whole validation run (s)."
    )
    session_start_seconds: float = Field(
        default=10.0, gt=0, le=600, description="Wall-clock limit of opening a session (load the code + reset) (s)."
    )
    step_seconds: float = Field(
        default=5.0, gt=0, le=600, description="Wall-clock limit of one session step as seen by the service (s)."
    )
    session_cpu_seconds: float = Field(
        default=120.0, gt=0, le=86_400, description="CPU-time rlimit of a whole session process (s)."
    )
    stdout_bytes: int = Field(
        default=1 << 20, ge=1024, le=1 << 30, description="Stdout kept from an execution; more is `output_limit`."
    )
    stderr_bytes: int = Field(
        default=1 << 20, ge=1024, le=1 << 30, description="Stderr kept from an execution; more is `output_limit`."
    )
    cgroup: Literal["auto", "required", "off"] = Field(
        "auto",
        description="The pool's cgroup holding all its jails in total (see isolation/cgroups.py): 'auto' makes "
        "one where the machine allows (v2, else v1) and otherwise says what holds; 'required' refuses to start "
        "without one; 'off' never makes one.",
    )
    total_memory_mb: int = Field(
        4096, ge=64, le=1 << 22, description="Memory of all the pool's jails together (its cgroup), MiB."
    )
    total_processes: int = Field(
        2048, ge=16, le=4_194_304, description="Processes of all the pool's jails together (its cgroup)."
    )
    cpu_weight: int = Field(
        100,
        ge=1,
        le=10_000,
        description="CPU weight of all the pool's jails together against other cgroups (cgroup v2 cpu.weight; "
        "v1 cpu.shares = weight x 10.24); 100 is an equal share.",
    )
    observation_bytes: int = Field(
        default=1 << 20,
        ge=1024,
        le=1 << 30,
        description="Largest encoded reply (observation + info) a session may send; more ends the session "
        "with outcome `limit`.",
    )

    @field_validator("allow_degraded")
    @classmethod
    def _degradable(cls, layers: list[str]) -> list[str]:
        if "python" in layers:
            raise ValueError(
                "allow_degraded cannot contain 'python': without the interpreter nothing can run; "
                "install python3.11 or point `python` at one"
            )
        return sorted(set(layers))

    @model_validator(mode="after")
    def _defaults_within_maxima(self) -> IsolationSettings:
        pairs = (
            ("cpu_seconds", "max_cpu_seconds"),
            ("memory_mb", "max_memory_mb"),
            ("wall_seconds", "max_wall_seconds"),
            ("max_memory_mb", "total_memory_mb"),
            ("processes", "total_processes"),
        )
        for default, maximum in pairs:
            if getattr(self, default) > getattr(self, maximum):
                raise ValueError(
                    f"{default}={getattr(self, default)} exceeds {maximum}={getattr(self, maximum)}: "
                    f"raise {maximum} or lower {default}"
                )
        return self
