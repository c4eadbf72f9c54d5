"""The process runner: every service of the distributed mode as a process of this machine, in order.

``up`` (idempotent: a member already running is left alone, a dead one is started again):

1. the database: Postgres reachable, the database created when missing, ``spade migrate``;
2. ``sandbox``, ``memory``, ``inference``, each waited for until healthy (gRPC health, ``/healthz``,
   ``/health_generate``);
3. the run spec stored in the memory (``SPADE_CLUSTER_RUN_SPEC``; a different stored spec stops here);
4. the seed pool loaded (``spade envs seed``, idempotent); 3 and 4 come after the servers when
   ``SPADE_CLUSTER_SERVICES`` names no worker;
5. ``learner``, ``rollout-1..N``, ``designer``, each waited for until it has run for a few seconds
   (one found running has).

``down`` stops them in the reverse order (SIGTERM, then SIGKILL of the process group after
``stop_grace_s``); ``status`` shows each process, its health and the queue's streams. Each process
logs to ``<run_dir>/logs/<name>.log``; keys are generated once into ``<run_dir>/keys.env`` (0600) and
given to every process, unless the env file sets them.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.cluster.envfile import parse_env_lines, read_env_files
from services.cluster.settings import ClusterSettings
from spade.auth import hash_key
from spade.dependencies import Dependency, DependencyUnavailable

SPADE = [sys.executable, "-m", "spade.cli"]

WORKER_SETTLE_S = 3.0
"""A worker (no server of its own) counts as up once it has run this long without exiting."""


MEMORY_ROLES: dict[str, dict[str, Any]] = {
    "operator": {"role": "admin"},  # `spade runspec set`
    "designer": {"role": "write"},
    "rollout": {"role": "write"},
    "learner": {"role": "write"},
}
"""Each generated memory key's role: what its holder does there and no more (docs/memory.md)."""


def with_memory_roles(keys: dict[str, str]) -> dict[str, str]:
    """``keys`` (a ``keys.env``) with :data:`MEMORY_ROLES` on memory keys that name no role.

    A ``keys.env`` written before memory keys had roles gave every tenant the default, ``write``,
    so the operator's ``spade runspec set`` would be refused; its tenants get their roles here.
    """
    raw = keys.get("SPADE_MEMORY_API_KEYS")
    if not raw:
        return keys
    entries = json.loads(raw)
    for entry in entries:
        entry.setdefault("role", MEMORY_ROLES.get(entry.get("tenant"), {}).get("role", "write"))
    return {**keys, "SPADE_MEMORY_API_KEYS": json.dumps(entries)}


class ClusterError(RuntimeError):
    """``up`` could not bring a member up (the message names it and quotes its log's tail)."""


@dataclass(frozen=True)
class Member:
    """One process of the cluster.

    Attributes:
        name: Its name (``rollout-2``), also its log file's and, for workers, its consumer name.
        role: The service it runs.
        argv: The ``spade`` arguments.
        env: Variables set for it alone.
        health: Checks it once; raises ``DependencyUnavailable`` while it is not healthy yet.
    """

    name: str
    role: str
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    health: Callable[[], None] | None = None


def _host(value: str | None) -> str:
    """Where to reach a server bound to ``value`` from this machine."""
    return "127.0.0.1" if value in (None, "", "0.0.0.0", "::") else str(value)


def describe_spec(shown: str) -> str:
    r"""One short line for the output of ``spade runspec show`` (``# run spec ID, stored AT`` and the JSON).

    >>> describe_spec('# run spec ab12, stored 2026-01-01T00:00:00+00:00\n{"group_size": 8, "window_versions_game": 4, '
    ...               '"window_versions_tool": 2, "agent_max_turns": 6, "temperature": 1.0}')
    'run spec ab12, stored 2026-01-01T00:00:00+00:00: G=8, k=4/2 game/tool, 6 turns, temperature 1.0'
    """
    lines = shown.strip().splitlines()
    head = lines[0].lstrip("# ").strip() if lines else "run spec (none shown)"
    try:
        spec = json.loads("\n".join(lines[1:]))
        return (
            f"{head}: G={spec['group_size']}, k={spec['window_versions_game']}/{spec['window_versions_tool']} "
            f"game/tool, {spec['agent_max_turns']} turns, temperature {spec['temperature']}"
        )
    except (ValueError, KeyError, TypeError):
        return head


class Cluster:
    """The runner over one env file (see the module docstring).

    Args:
        env_files: The env files, read in order (``deploy/spade.env``, ``deploy/local.env``).
        environ: The process environment (it wins over the file; default ``os.environ``).
        out: Where progress lines go (default: stderr).
    """

    def __init__(
        self,
        env_files: Sequence[Path] | Path,
        environ: Mapping[str, str] | None = None,
        out: Callable[[str], None] | None = None,
    ) -> None:
        self.environ = dict(os.environ if environ is None else environ)
        files = [env_files] if isinstance(env_files, Path) else list(env_files)
        self.values = read_env_files(files, self.environ)
        # The runner's own settings: SPADE_CLUSTER_* of the environment, also those the file leaves out.
        prefix = "SPADE_CLUSTER_"
        cluster = {
            k.removeprefix(prefix).lower(): v
            for k, v in {**self.environ, **self.values}.items()
            if k.startswith(prefix) and k.removeprefix(prefix).lower() in ClusterSettings.model_fields
        }
        self.settings = ClusterSettings.model_validate(cluster)
        self.run_dir = self.settings.run_dir.resolve()
        self.log_dir = self.run_dir / "logs"
        self.state_file = self.run_dir / "state.json"
        self._out = out or (lambda line: print(line, file=sys.stderr, flush=True))
        self._children: dict[int, subprocess.Popen[bytes]] = {}

    # -- configuration ------------------------------------------------------------------------------

    def value(self, name: str, default: str) -> str:
        """A variable as every process sees it (the file, the environment, the generated keys)."""
        return self.env().get(name, default)

    def keys(self) -> dict[str, str]:
        """The generated keys and their hashes (made on first use, kept in ``keys.env``)."""
        path = self.run_dir / "keys.env"
        if path.exists():
            return with_memory_roles(parse_env_lines(path.read_text().splitlines(), {}, source=str(path)))
        key = {name: secrets.token_urlsafe(32) for name in ("operator", "designer", "rollout", "learner", "memory")}

        def tenants(*names: str, **extra: dict[str, Any]) -> str:
            return json.dumps([{"tenant": n, "key_sha256": hash_key(key[n]), **extra.get(n, {})} for n in names])

        generated = {
            "SPADE_CLUSTER_OPERATOR_KEY": key["operator"],
            "SPADE_SANDBOX_API_KEYS": tenants(
                "operator", "designer", "rollout", "memory",
                rollout={"max_sessions": 256, "executions_per_minute": 100_000},
            ),
            "SPADE_MEMORY_API_KEYS": tenants("operator", "designer", "rollout", "learner", **MEMORY_ROLES),
            "SPADE_INFERENCE_API_KEYS": tenants("operator", "designer", "rollout"),
            "SPADE_INFERENCE_ADMIN_KEYS": tenants("learner"),
            "SPADE_DESIGNER_SANDBOX__API_KEY": key["designer"],
            "SPADE_DESIGNER_MEMORY__API_KEY": key["designer"],
            "SPADE_DESIGNER_INFERENCE__API_KEY": key["designer"],
            "SPADE_ROLLOUT_SANDBOX__API_KEY": key["rollout"],
            "SPADE_ROLLOUT_MEMORY__API_KEY": key["rollout"],
            "SPADE_ROLLOUT_INFERENCE__API_KEY": key["rollout"],
            "SPADE_LEARNER_MEMORY__API_KEY": key["learner"],
            "SPADE_LEARNER_INFERENCE__API_KEY": key["learner"],
            "SPADE_MEMORY_SANDBOX__API_KEY": key["memory"],
            # The CLIs (spade envs seed, spade runspec) read these.
            "SPADE_MEMORY_API_KEY": key["operator"],
            "SPADE_SANDBOX_API_KEY": key["operator"],
        }  # fmt: skip
        self.run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("# Generated by `spade cluster up`: this cluster's keys. Keep it private.\n")
            f.writelines(f"{k}='{v}'\n" for k, v in generated.items())
        return generated

    def env(self) -> dict[str, str]:
        """Every process's environment: the generated keys, under the process environment and the file."""
        env = {**self.keys(), **self.environ, **self.values}
        env.setdefault("PYTHONUNBUFFERED", "1")
        env.setdefault("HF_HUB_OFFLINE", "1")
        if "SPADE_LEARNER_MODEL_PATH" not in env and "learner" in self.settings.services:
            from spade.inference.models import resolve_model_path

            env["SPADE_LEARNER_MODEL_PATH"] = str(resolve_model_path(None))
        return env

    def members(self) -> list[Member]:
        """The processes to run, in start order."""
        env = self.env()
        grpc_sandbox = f"{_host(env.get('SPADE_SANDBOX_GRPC__HOST'))}:{env.get('SPADE_SANDBOX_GRPC__PORT', '50051')}"
        memory_http = f"http://{_host(env.get('SPADE_MEMORY_HTTP__HOST'))}:{env.get('SPADE_MEMORY_HTTP__PORT', '8082')}"
        inference = (
            f"http://{_host(env.get('SPADE_INFERENCE_HTTP__HOST'))}:{env.get('SPADE_INFERENCE_HTTP__PORT', '30000')}"
        )
        timeout = 5.0
        checks: dict[str, Callable[[], None]] = {
            "sandbox": Dependency("grpc", grpc_sandbox, timeout).check,
            "memory": Dependency("http", f"{memory_http}/healthz", timeout).check,
            "inference": Dependency("http", f"{inference}/health_generate", 30.0).check,
        }
        out: list[Member] = []
        for role in self.settings.services:
            if role == "rollout":
                for i in range(1, self.settings.rollout_workers + 1):
                    name = f"rollout-{i}"
                    out.append(Member(name, role, ("serve", role), {"SPADE_ROLLOUT_CONSUMER_NAME": name}))
            else:
                out.append(Member(role, role, ("serve", role), {}, checks.get(role)))
        order = {role: i for i, role in enumerate(("sandbox", "memory", "inference", "learner", "rollout", "designer"))}
        return sorted(out, key=lambda m: order[m.role])

    # -- process state -----------------------------------------------------------------------------

    def _state(self) -> dict[str, dict[str, Any]]:
        if not self.state_file.exists():
            return {}
        state: dict[str, dict[str, Any]] = json.loads(self.state_file.read_text())
        return state

    def _save(self, state: dict[str, dict[str, Any]]) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(self.state_file)

    @staticmethod
    def alive(pid: int | None) -> bool:
        """Whether ``pid`` is a live (not zombie) ``spade`` process."""
        if not pid:
            return False
        try:
            status = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, IndexError):
            return False
        return status != "Z" and b"spade" in cmdline

    def running(self, pid: int) -> bool:
        """Whether ``pid`` still runs: exact for a process this runner started (its child, even while it
        is still exec'ing and its command line reads empty), else :meth:`alive`."""
        child = self._children.get(pid)
        if child is not None:
            return child.poll() is None
        return self.alive(pid)

    def pid(self, name: str) -> int | None:
        """The recorded pid of ``name`` if that process still runs."""
        pid = self._state().get(name, {}).get("pid")
        return int(pid) if pid is not None and self.alive(int(pid)) else None

    def log_tail(self, name: str, chars: int = 3000) -> str:
        """The end of ``name``'s log."""
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else "(no log)"

    # -- up ------------------------------------------------------------------------------------------

    def _run(self, what: str, argv: list[str], env: Mapping[str, str], timeout_s: float = 600) -> str:
        self._out(f"cluster: {what}")
        done = subprocess.run(argv, env=dict(env), capture_output=True, text=True, timeout=timeout_s, check=False)
        if done.returncode != 0:
            raise ClusterError(f"{what} failed (exit {done.returncode}):\n{(done.stderr or done.stdout)[-3000:]}")
        return done.stdout

    def database(self, env: Mapping[str, str]) -> None:
        """Postgres reachable, the database created when missing, the schema migrated."""
        url = env.get("SPADE_MEMORY_DATABASE_URL", "")
        if url.startswith("postgresql"):
            import psycopg

            dsn = "postgresql://" + url.split("://", 1)[1]
            name = dsn.rsplit("/", 1)[1].split("?", 1)[0]
            admin = dsn.rsplit("/", 1)[0] + "/postgres"
            with psycopg.connect(admin, autocommit=True, connect_timeout=10) as conn:
                if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone() is None:
                    conn.execute(f'CREATE DATABASE "{name}"')
                    self._out(f"cluster: created database {name}")
        self._run("spade migrate", [*SPADE, "migrate"], env)

    def start(self, member: Member, env: Mapping[str, str]) -> int:
        """Start ``member`` (its output appended to its log); returns its pid."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = (self.log_dir / f"{member.name}.log").open("ab")
        log.write(f"\n===== spade cluster: starting {member.name} at {time.strftime('%F %T')}\n".encode())
        log.flush()
        proc = subprocess.Popen(
            [*SPADE, *member.argv],
            env={**env, **member.env},
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # the cluster outlives `spade cluster up`; down signals the group
        )
        log.close()
        self._children[proc.pid] = proc
        state = self._state()
        state[member.name] = {"pid": proc.pid, "role": member.role, "argv": list(member.argv), "started": time.time()}
        self._save(state)
        return proc.pid

    def wait_healthy(self, member: Member, pid: int, ran_s: float = 0.0) -> None:
        """Until ``member`` answers its health check (or, a worker, has run a few seconds).

        Args:
            member: The member.
            pid: Its process.
            ran_s: How long it has run already (a member ``up`` found running has settled long ago).

        Raises:
            ClusterError: It exited, or was not healthy within ``health_timeout_s``.
        """
        now = time.monotonic()
        started = now - max(0.0, ran_s)
        deadline = now + self.settings.health_timeout_s
        last = "not checked yet"
        next_note = now + 30
        while time.monotonic() < deadline:
            if not self.running(pid):
                raise ClusterError(f"{member.name} exited while starting; its log ends:\n{self.log_tail(member.name)}")
            if member.health is None:
                if time.monotonic() - started >= WORKER_SETTLE_S:
                    return
            else:
                try:
                    member.health()
                    return
                except (DependencyUnavailable, OSError) as exc:
                    last = str(exc)
            if time.monotonic() >= next_note:
                self._out(f"cluster: still waiting for {member.name} ({time.monotonic() - now:.0f} s: {last})")
                next_note += 30
            time.sleep(0.5)
        raise ClusterError(
            f"{member.name} was not healthy within {self.settings.health_timeout_s:.0f} s ({last}); "
            f"its log ends:\n{self.log_tail(member.name)}"
        )

    def up(self) -> None:
        """Bring every member up (see the module docstring); members already running are left alone."""
        env = self.env()
        members = self.members()
        if not any(self.pid(m.name) for m in members):
            self.database(env)
        prepared = False
        for member in members:
            if member.role in ("learner", "rollout", "designer") and not prepared:
                self.prepare(env)
                prepared = True
            pid = self.pid(member.name)
            ran_s = 0.0
            if pid is None:
                pid = self.start(member, env)
                self._out(f"cluster: started {member.name} (pid {pid}), waiting until it is healthy")
            else:
                ran_s = time.time() - float(self._state()[member.name].get("started", time.time()))
            self.wait_healthy(member, pid, ran_s)
            self._out(f"cluster: {member.name} is up (pid {pid})")
        if not prepared:  # no worker among the services: the servers are up, the run can be prepared now
            self.prepare(env)

    def prepare(self, env: Mapping[str, str]) -> None:
        """The run spec stored (or shown) and the seed pool loaded, before the workers start (idempotent)."""
        roles = set(self.settings.services)
        if "memory" not in roles:
            return
        memory = env.get("SPADE_MEMORY_TARGET", "127.0.0.1:50052")
        if self.settings.run_spec is not None:
            spec = str(self.settings.run_spec)
            self._run(f"spade runspec set {spec}", [*SPADE, "runspec", "set", spec, "--memory", memory], env)
        shown = self._run("spade runspec show", [*SPADE, "runspec", "show", "--memory", memory], env)
        self._out("cluster: " + describe_spec(shown))
        if self.settings.seed_examples and "sandbox" in roles:
            argv = [*SPADE, "envs", "seed", "--setting", self.settings.seed_setting, "--memory", memory]
            argv += ["--queue", json.dumps(self.queue_config(env))]
            argv += ["--sandbox", env.get("SPADE_ROLLOUT_SANDBOX__TARGET", "127.0.0.1:50051")]
            argv += ["--window", str(self.settings.seed_window)]
            for name in self.settings.seed_examples:
                argv += ["--example", name]
            self._out("cluster: " + self._run("spade envs seed", argv, env).strip().splitlines()[0])

    @staticmethod
    def queue_config(env: Mapping[str, str]) -> dict[str, Any]:
        """The rollout's queue (URL and prefix), as every service shares it."""
        if "SPADE_ROLLOUT_QUEUE" in env:
            loaded: dict[str, Any] = json.loads(env["SPADE_ROLLOUT_QUEUE"])
            return loaded
        return {
            "kind": "redis",
            "url": env.get("SPADE_ROLLOUT_QUEUE__URL", "redis://127.0.0.1:6379/0"),
            "prefix": env.get("SPADE_ROLLOUT_QUEUE__PREFIX", "spade:"),
        }

    # -- down, kill, status --------------------------------------------------------------------------

    def kill(self, name: str, sig: int = signal.SIGKILL) -> int:
        """Send ``sig`` to ``name``'s process group (the chaos test's kill -9); returns the pid."""
        pid = self.pid(name)
        if pid is None:
            raise ClusterError(f"{name} is not running")
        os.killpg(pid, sig)
        return pid

    def down(self) -> None:
        """Stop every recorded process by role, the last started first (designer, rollout workers,
        learner, inference, memory, sandbox): SIGTERM, then SIGKILL after the grace. The members of a
        role (the rollout workers) get SIGTERM together, and each is reported as it exits."""
        state = self._state()
        order = ["designer", "rollout", "learner", "inference", "memory", "sandbox"]
        tiers: list[list[str]] = [[n for n, s in state.items() if s.get("role") == role] for role in order]
        tiers.append([n for n, s in state.items() if s.get("role") not in order])
        for tier in tiers:
            latest_first = sorted(tier, key=lambda n: float(state[n].get("started") or 0), reverse=True)
            running = {name: pid for name in latest_first if (pid := self.pid(name))}
            if not running:
                continue
            together = " together" if len(running) > 1 else ""
            named = ", ".join(f"{name} (pid {pid})" for name, pid in running.items())
            self._out(f"cluster: stopping {named}{together}: SIGTERM")
            for pid in running.values():
                os.kill(pid, signal.SIGTERM)
            began = time.monotonic()
            deadline = began + self.settings.stop_grace_s
            while running and time.monotonic() < deadline:
                for name in [n for n, p in running.items() if not self.alive(p)]:
                    self._out(f"cluster: {name} stopped ({time.monotonic() - began:.1f} s)")
                    del running[name]
                time.sleep(0.2)
            for name, pid in running.items():
                self._out(f"cluster: {name} ignored SIGTERM for {self.settings.stop_grace_s:.0f} s; killing it")
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
        for name in state:  # anything a killed parent left behind in its group
            pid = int(state[name].get("pid") or 0)
            try:
                if pid:
                    os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self._save({})

    def status(self, window_min: float | None = None) -> dict[str, Any]:
        """Each member's pid and health, and what the cluster is doing (``services/cluster/status.py``)."""
        from services.cluster.status import DEFAULT_WINDOW_MIN, collect

        return collect(self, DEFAULT_WINDOW_MIN if window_min is None else window_min)
