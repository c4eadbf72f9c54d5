"""Sandbox speed against baselines and peers measured in the same run (issues 14 and 22).

    .venv/bin/python bench/sandbox_bench.py [--sessions 40] [--steps 400] [--executions 40] [--json]

- one-shot ``execute`` of ``print(1)`` and session start for never-seen code (every start a
  different source, so nothing is cached) against two peers, each running ``python3 -S -c 'print(1)'``
  per request in the way another sandbox service would (target, issue 22: our p50 at least 2x faster
  than the bubblewrap peer's, at equal or stronger isolation):

  - bubblewrap: ``bwrap --unshare-all --die-with-parent --ro-bind / / --dev /dev --proc /proc
    --tmpfs /tmp -- python3 -S -c 'print(1)'`` (new user, ipc, pid, net, uts and cgroup namespaces, the
    host's whole filesystem read-only, a fresh ``/dev``, ``/proc`` and ``/tmp``);
  - unshare: ``unshare --fork --pid --mount --net --ipc --uts --mount-proc python3 -S -c 'print(1)'``
    (needs root; no user namespace, the host's filesystem writable);

  the calls run in rounds (one of ours, one of each peer, the order rotating each round), so the
  machine's load falls on both alike. Every timed execute and session start, ours and the peers',
  comes after a pause of ``PAUSE_S``, so no call's leftover work (our pool building its next spare
  jail, a peer's namespaces torn down) runs into the next call's time; before issue 22 ours ran
  back to back. Both tools are run as this process's user: as root, bwrap's user namespace maps
  uid 0 to the host's root and keeps every capability inside it. A peer whose tool is missing or
  fails here is skipped, saying why, and its ratios are null;
- the same execute against a fresh ``python3 -S -c 'print(1)'`` per call, and the never-seen start's
  target p50 <= 3 ms (issue 14). The old target "execute >= 5x a fresh interpreter" is retired
  (issue 22: the peers are the comparison that matters); its figures and floors are still printed;
- session start for code the pool has validated;
- step round trip against the machine's pipe ping-pong: two processes bouncing a 64-byte message over
  a pair of pipes (target: within 5x);
- steps/s of one session, and the fresh-interpreter baselines of a session start and a step;
- a whole validation of a game and of a tool example (every episode it plays is a session);
- floors: what the same work costs with no isolation at all, in the sandbox's interpreter: the env's
  own ``EnvSession.step`` in a warm process, and a process forked per call from a warm interpreter
  that loads never-seen code and resets it, or runs ``print(1)``. No isolation layer can make a
  request cheaper than its floor; the ``*_floor`` ratios say how far the targets are from it.

Also CPU time per call, which a busy machine inflates far less than wall time: the pool's (each
zygote and every jail it has reaped, from ``/proc``: kernel worker threads, such as a network
namespace's teardown, are not counted), the service's (this process, launching the peers left
out), and a fresh interpreter's. Not the peers': bwrap's outer process does not reap its pid
namespace's init, so its CPU never reaches this process's ``RUSAGE_CHILDREN``.

Prints p50/p99 in milliseconds and the ratios, each with its target; ``--json`` prints one object
instead (figures, baseline and peer figures, CPU per call, ratios, targets, the peers' commands or
why they were skipped, the load average at start). Not a test: nothing is asserted (machines are
shared and noisy); measure when ``uptime`` shows a quiet machine, or report the load with the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import json
import os
import resource
import shlex
import shutil
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.sandbox.isolation import IsolationSettings, SandboxPool  # noqa: E402
from spade.envs import CheckConfig  # noqa: E402
from spade.envs.examples import EXAMPLES  # noqa: E402

ENV = EXAMPLES["code_breaker"]
TOOL_ENV = EXAMPLES["order_desk"]
ACTION = "\\boxed{guess 1 2 3 4}"
PYTHON = "/usr/bin/python3.11"
# The peers (issue 22): each wraps a fresh interpreter that prints 1, as another sandbox service would.
PEER_PROGRAM = [PYTHON, "-S", "-c", "print(1)"]
BWRAP_FLAGS = ["--unshare-all", "--die-with-parent", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
               "--tmpfs", "/tmp", "--"]  # fmt: skip
UNSHARE_FLAGS = ["--fork", "--pid", "--mount", "--net", "--ipc", "--uts", "--mount-proc"]
PEER_TARGET = 2.0
"""Issue 22: our execute and never-seen session start at least this many times faster than bubblewrap's (p50)."""
RETIRED = "issue 22 retired it: the peers are the comparison; its figure and floor are still measured"
"""Why ``execute_speedup >= 5`` (a fresh interpreter per call, issue 14) is no longer a target."""
RATIO_TARGETS = {
    "execute_speedup": "(target >= 5: retired by issue 22)",
    "step_over_ping_pong": "(target <= 5)",
    "execute_speedup_bwrap": f"(target >= {PEER_TARGET:g})",
    "session_start_speedup_never_seen_bwrap": f"(target >= {PEER_TARGET:g})",
}
"""What the text output prints beside each ratio that has (or had) a target."""
PAUSE_S = 0.05
"""Pause before every timed execute and session start (ours and the peers' alike): our pool's next
spare jail, or a peer's namespaces torn down by kernel workers, would otherwise run into the next
call's time, whoever's it is."""
# The baseline's whole job per call: a fresh interpreter that loads the env and answers one call.
BASELINE_RESET = (
    "import sys; sys.path.insert(0, {root!r}); from spade.envs import EnvSession; "
    "s = EnvSession(sys.stdin.read(), 'game', 1); print(s.reset().to_dict()['turn'])"
)
BASELINE_STEP = (
    "import sys; sys.path.insert(0, {root!r}); from spade.envs import EnvSession; "
    "s = EnvSession(sys.stdin.read(), 'game', 1); s.reset(); print(s.step({action!r}).to_dict()['turn'])"
)
# The floors, run by PYTHON: the sandbox's work with none of its isolation (no namespaces, no jail
# processes, no channels), from a warm interpreter as the zygote is one.
FLOORS = """
import json, os, sys, time
sys.path.insert(0, {root!r})
from spade.envs import CheckConfig, EnvSession
from spade.envs.loader import compile_env, load_env_class

code, action, steps, starts, executions = {code!r}, {action!r}, {steps}, {starts}, {executions}
config = CheckConfig()


def start(source):
    loaded = load_env_class(source, "game", compile_env(source))
    session = EnvSession.from_class(loaded.env_class, "game", 1, config)
    session.reset()
    return session


def forked(work):
    begin = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        work()
        sys.stdout.flush()
        os._exit(0)
    os.waitpid(pid, 0)
    return (time.perf_counter() - begin) * 1000


step = []
session = start(code)
while len(step) < steps:
    if session.done:
        session = start(code)
    begin = time.perf_counter()
    session.step(action)
    step.append((time.perf_counter() - begin) * 1000)
start_forked = [forked(lambda: start(code + "\\n# never seen: %d\\n" % i)) for i in range(starts)]
null = os.open(os.devnull, os.O_WRONLY)
os.dup2(null, 1)
execute_forked = [forked(lambda: exec(compile("print(1)", "main.py", "exec"), {{}})) for _ in range(executions)]
sys.stderr.write(json.dumps({{"env_step": step, "session_start": start_forked, "execute": execute_forked}}))
"""


TICK_MS = 1000 / os.sysconf("SC_CLK_TCK")
SETTLE_S = 0.3
"""Pause before reading the CPU meter, so the jails of the calls just made are reaped."""


def _stat(pid: int) -> list[str]:
    """The fields of ``/proc/PID/stat`` after the command name (the state is [0], utime [11])."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


class CpuMeter:
    """CPU ms of the pool's processes (utime+stime+cutime+cstime of each zygote) and of this one."""

    def __init__(self, pool: SandboxPool) -> None:
        parents = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    parents[int(entry.name)] = int(_stat(int(entry.name))[1])
                except (OSError, IndexError):
                    continue
        launchers = {z["pid"] for z in pool.health()["zygotes"]}
        below: set[int] = set()
        for pid in parents:
            cursor = pid
            while cursor in parents and cursor not in launchers and cursor > 1:
                cursor = parents[cursor]
            if cursor in launchers:
                below.add(pid)
        # A zygote runs the sandbox's python; its parent (bubblewrap) does not.
        self.zygotes = [pid for pid in below if _comm(pid) == Path(PYTHON).name and _comm(parents[pid]) != _comm(pid)]

    def read(self) -> tuple[float, float]:
        pool = sum(sum(int(x) for x in _stat(pid)[11:15]) for pid in self.zygotes) * TICK_MS
        return pool, time.process_time() * 1000


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


async def metered(
    meter: CpuMeter, calls: int, body: Callable[[], Awaitable[Any]], peers: Sequence[Peer] = ()
) -> dict[str, float]:
    """Run ``body`` (``calls`` calls of ours); the pool's and the service's CPU ms per call of ours.

    What the service spends launching ``peers`` in the same body is left out of its figure.
    """
    pool0, service0 = meter.read()
    outside0 = sum(peer.service_ms for peer in peers)
    await body()
    await asyncio.sleep(SETTLE_S)
    pool1, service1 = meter.read()
    service = service1 - service0 - (sum(peer.service_ms for peer in peers) - outside0)
    return {"pool": round((pool1 - pool0) / calls, 3), "service": round(service / calls, 3)}


def children_cpu_ms() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (usage.ru_utime + usage.ru_stime) * 1000


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def figures(samples: list[float]) -> dict[str, float]:
    return {"p50_ms": round(pct(samples, 0.5), 4), "p99_ms": round(pct(samples, 0.99), 4), "n": len(samples)}


async def timed(call: Callable[[], Awaitable[Any]], n: int) -> list[float]:
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        await call()
        samples.append((time.perf_counter() - start) * 1000)
    return samples


async def fresh_python(code: str, stdin: bytes = b"") -> bytes:
    proc = await asyncio.create_subprocess_exec(
        PYTHON, "-S", "-c", code, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
    )
    out, _ = await proc.communicate(stdin)
    if proc.returncode != 0:
        raise RuntimeError(f"baseline subprocess failed with {proc.returncode}")
    return out


@dataclass
class Peer:
    """A peer's way to run one request: a tool wrapping ``python3 -S -c 'print(1)'`` (see the module docstring).

    Attributes:
        name: the tool's name, used in the figures' keys.
        argv: the whole command of one request.
        skipped: why the peer is not measured (its tool is missing or fails here), or ``None``.
        samples: wall ms of each call, by the phase its rounds belong to (``execute``, ``session_start``).
        service_ms: this process's CPU ms spent launching and reaping it, kept out of the service's figure.
    """

    name: str
    argv: list[str]
    skipped: str | None = None
    samples: dict[str, list[float]] = field(default_factory=dict)
    service_ms: float = 0.0

    @classmethod
    async def probe(cls, tool: str, flags: list[str], package: str) -> Peer:
        """The peer, run twice here (the warm-up), or skipped saying why."""
        path = shutil.which(tool)
        peer = cls(tool, [path or tool, *flags, *PEER_PROGRAM])
        if path is None:
            peer.skipped = f"{tool} is not on PATH; install Debian's {package} package"
            return peer
        try:
            for _ in range(2):
                await peer.run()
        except RuntimeError as exc:
            peer.skipped = str(exc)
        return peer

    async def run(self) -> tuple[float, float]:
        """One request: its wall ms and this process's CPU ms.

        The peer's own CPU is not measured: with ``--unshare-pid`` bwrap's outer process exits
        without reaping its child, so the child's time never reaches our ``RUSAGE_CHILDREN``.

        Raises:
            RuntimeError: when it does not print 1 and exit 0, with the tool's own words.
        """
        begin, service = time.perf_counter(), time.process_time()
        proc = await asyncio.create_subprocess_exec(
            *self.argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        out, err = await proc.communicate()
        elapsed = (time.perf_counter() - begin) * 1000
        if proc.returncode != 0 or out != b"1\n":
            said = (err or out).decode(errors="replace").strip()[-300:]
            raise RuntimeError(f"{self.name} fails here (exit {proc.returncode}): {said}")
        return elapsed, (time.process_time() - service) * 1000

    async def call(self, phase: str) -> None:
        """One request, its wall ms kept under ``phase``."""
        elapsed, service_ms = await self.run()
        self.samples.setdefault(phase, []).append(elapsed)
        self.service_ms += service_ms

    def figures(self, phase: str) -> dict[str, float] | None:
        return None if self.skipped else figures(self.samples[phase])

    def speedup(self, phase: str, ours: list[float]) -> float | None:
        """The peer's p50 over ours, in ``phase``; ``None`` when skipped."""
        return None if self.skipped else round(pct(self.samples[phase], 0.5) / pct(ours, 0.5), 2)


async def interleaved(rounds: int, ours: Callable[[], Awaitable[None]], peers: Sequence[Peer], phase: str) -> None:
    """``rounds`` rounds of one call of ours and one of each peer, the order rotating, a pause before each."""
    calls: list[Callable[[], Awaitable[None]]] = [ours]
    calls += [functools.partial(peer.call, phase) for peer in peers if not peer.skipped]
    for i in range(rounds):
        turn = i % len(calls)
        for call in calls[turn:] + calls[:turn]:
            await asyncio.sleep(PAUSE_S)
            await call()


async def measure_floors(args: argparse.Namespace) -> dict[str, list[float]]:
    """Run ``FLOORS`` in the sandbox's interpreter; its samples (ms) by name."""
    script = FLOORS.format(
        root=str(ROOT),
        code=ENV.code,
        action=ACTION,
        steps=args.steps,
        starts=args.sessions,
        executions=args.executions,
    )
    proc = await asyncio.create_subprocess_exec(
        PYTHON, "-S", "-c", script, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
    )
    _, err = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"the floors script failed with {proc.returncode}: {err[-500:]!r}")
    samples: dict[str, list[float]] = json.loads(err)
    return samples


def pipe_ping_pong(rounds: int) -> list[float]:
    """Round trips of a 64-byte message between this process and a forked child over two pipes."""
    to_child, from_parent = os.pipe()
    to_parent, from_child = os.pipe()
    message = b"x" * 64
    pid = os.fork()
    if pid == 0:
        try:
            for _ in range(rounds):
                os.write(from_child, os.read(to_child, 64))
        finally:
            os._exit(0)
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        os.write(from_parent, message)
        os.read(to_parent, 64)
        samples.append((time.perf_counter() - start) * 1000)
    os.waitpid(pid, 0)
    for fd in (to_child, from_parent, to_parent, from_child):
        os.close(fd)
    return samples


def at_least(ratio: float | None, target: float) -> bool | None:
    """Whether ``ratio`` meets ``target``; ``None`` when its peer was skipped."""
    return None if ratio is None else ratio >= target


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    config = CheckConfig()
    unique = itertools.count()
    out: dict[str, Any] = {"sandbox": {}, "baseline": {}, "cpu_ms_per_call": {}, "ratios": {}}
    cpu = out["cpu_ms_per_call"]
    peers = [
        await Peer.probe("bwrap", BWRAP_FLAGS, "bubblewrap"),
        await Peer.probe("unshare", UNSHARE_FLAGS, "util-linux"),
    ]
    out["peers"] = {peer.name: {"command": shlex.join(peer.argv), "skipped": peer.skipped} for peer in peers}
    async with SandboxPool(IsolationSettings(spares=args.spares, cgroup=args.cgroup)) as pool:
        out["cgroup"] = pool.health()["cgroup"]["detail"]
        meter = CpuMeter(pool)
        # Warm-up: the first forks fault in the zygote's pages.
        for _ in range(5):
            await (await pool.open_session(ENV.code, "game", 1, config)).close()
            await pool.execute("pass")
        closing: list[Any] = []

        async def start(code: str) -> None:
            session = await pool.open_session(code, "game", 1, config)
            assert session.initial.outcome.value == "ok", session.initial
            closing.append(session)  # closing is part of a session's life, not of its start

        async def close_all() -> None:
            while closing:
                await closing.pop().close()

        cold: list[float] = []
        warm: list[float] = []

        async def one_start(samples: list[float], code: str) -> None:
            samples += await timed(lambda: start(code), 1)
            await close_all()

        async def never_seen() -> None:
            await one_start(cold, f"{ENV.code}\n# never seen: {next(unique)}\n")

        cpu["session_start_never_seen"] = await metered(
            meter, args.sessions, lambda: interleaved(args.sessions, never_seen, peers, "session_start"), peers
        )
        assert (await pool.validate(ENV.code, "game", config)).valid
        cpu["session_start_validated"] = await metered(
            meter, args.sessions, lambda: interleaved(args.sessions, lambda: one_start(warm, ENV.code), (), "")
        )

        steps: list[float] = []
        stepping_ms = 0.0  # the service's CPU in steps only (the env's process is reaped with its session)
        session = await pool.open_session(ENV.code, "game", 1, config)
        while len(steps) < args.steps:
            begin, begin_cpu = time.perf_counter(), time.process_time()
            outcome = await session.step(ACTION)
            steps.append((time.perf_counter() - begin) * 1000)
            stepping_ms += (time.process_time() - begin_cpu) * 1000
            if outcome.terminated or outcome.truncated:
                await session.close()
                session = await pool.open_session(ENV.code, "game", 1, config)
        await session.close()
        cpu["step_round_trip"] = {"service": round(stepping_ms / len(steps), 3)}

        executions: list[float] = []

        async def execute() -> None:
            executions.extend(await timed(lambda: pool.execute("print(1)"), 1))

        cpu["execute_print_1"] = await metered(
            meter, args.executions, lambda: interleaved(args.executions, execute, peers, "execute"), peers
        )

        # A whole validation: every episode it plays is a session of its own (validation is
        # indistinguishable from play), so its cost is about (sessions it opens) x a session start.
        for name, example in (("validate_game", ENV), ("validate_tool", TOOL_ENV)) if args.validations > 0 else ():

            async def validate(code: str = example.code, setting: str = example.setting.value) -> None:
                await pool.validate(code, setting, config)

            out["sandbox"][name] = figures(await timed(validate, args.validations))

    ping = pipe_ping_pong(args.steps)
    root = str(ROOT)
    code = ENV.code.encode()
    before = children_cpu_ms()
    base_start = await timed(lambda: fresh_python(BASELINE_RESET.format(root=root), code), args.baseline)
    cpu["fresh_python_session_start"] = round((children_cpu_ms() - before) / args.baseline, 3)
    base_step = await timed(lambda: fresh_python(BASELINE_STEP.format(root=root, action=ACTION), code), args.baseline)
    before = children_cpu_ms()
    base_exec = await timed(lambda: fresh_python("print(1)"), args.baseline)
    cpu["fresh_python_execute"] = round((children_cpu_ms() - before) / args.baseline, 3)
    floors = await measure_floors(args)

    sandbox, baseline, ratios = out["sandbox"], out["baseline"], out["ratios"]
    sandbox["session_start_never_seen"] = figures(cold)
    sandbox["session_start_validated"] = figures(warm)
    sandbox["step_round_trip"] = figures(steps)
    sandbox["steps_per_s"] = round(len(steps) / (sum(steps) / 1000), 1)
    sandbox["execute_print_1"] = figures(executions)
    baseline["pipe_ping_pong"] = figures(ping)
    baseline["fresh_python_session_start"] = figures(base_start)
    baseline["fresh_python_step"] = figures(base_step)
    baseline["fresh_python_execute"] = figures(base_exec)
    baseline["floor_env_step_in_process"] = figures(floors["env_step"])
    baseline["floor_session_start_forked"] = figures(floors["session_start"])
    baseline["floor_execute_forked"] = figures(floors["execute"])
    for peer in peers:
        baseline[f"{peer.name}_print_1_beside_execute"] = peer.figures("execute")
        baseline[f"{peer.name}_print_1_beside_session_start"] = peer.figures("session_start")
    ratios["execute_speedup"] = round(pct(base_exec, 0.5) / pct(executions, 0.5), 2)
    ratios["step_over_ping_pong"] = round(pct(steps, 0.5) / pct(ping, 0.5), 2)
    ratios["session_start_speedup_never_seen"] = round(pct(base_start, 0.5) / pct(cold, 0.5), 2)
    ratios["session_start_speedup_validated"] = round(pct(base_start, 0.5) / pct(warm, 0.5), 2)
    ratios["steps_per_s_speedup"] = round(sandbox["steps_per_s"] / (1000 / statistics.mean(base_step)), 1)
    # The best each target could be with no isolation at all (a fork per call, the env's own step).
    spent = cpu["execute_print_1"]["pool"] + cpu["execute_print_1"]["service"]
    ratios["execute_cpu_speedup"] = round(cpu["fresh_python_execute"] / spent, 2) if spent else None
    ratios["execute_speedup_floor"] = round(pct(base_exec, 0.5) / pct(floors["execute"], 0.5), 2)
    ratios["step_over_ping_pong_floor"] = round(pct(floors["env_step"], 0.5) / pct(ping, 0.5), 2)
    for peer in peers:
        ratios[f"execute_speedup_{peer.name}"] = peer.speedup("execute", executions)
        ratios[f"session_start_speedup_never_seen_{peer.name}"] = peer.speedup("session_start", cold)
    out["targets"] = {
        f"{name} >= {PEER_TARGET:g}": at_least(ratios[name], PEER_TARGET)
        for name in ("execute_speedup_bwrap", "session_start_speedup_never_seen_bwrap")
    } | {
        "session_start_never_seen p50 <= 3 ms": sandbox["session_start_never_seen"]["p50_ms"] <= 3.0,
        "step_over_ping_pong <= 5": ratios["step_over_ping_pong"] <= 5,
    }
    out["retired_targets"] = {"execute_speedup >= 5": RETIRED}
    return out


def report(out: dict[str, Any]) -> None:
    def line(name: str, f: dict[str, float] | None) -> str:
        if f is None:
            return f"{name:<40} skipped"
        return f"{name:<40} p50 {f['p50_ms']:8.3f} ms   p99 {f['p99_ms']:8.3f} ms   (n={f['n']})"

    print(f"load average at start: {out['load_average']}   cgroup: {out['cgroup']}")
    for name, peer in out["peers"].items():
        if peer["skipped"]:
            print(f"peer {name}: SKIPPED, its ratios are null: {peer['skipped']}")
        else:
            print(f"peer {name}: {peer['command']}")
    print("sandbox (isolated zygote, every layer on)")
    for name, value in out["sandbox"].items():
        print(line(name, value) if isinstance(value, dict) else f"{name:<40} {value}")
    print("CPU ms per call (pool: zygotes and reaped jails; service: this process)")
    for name, value in out["cpu_ms_per_call"].items():
        print(f"  {name:<38} {value}")
    print("baselines and peers (same run; the peers interleaved with our execute and never-seen start)")
    for name, value in out["baseline"].items():
        print(line(name, value))
    print("ratios")
    for name, value in out["ratios"].items():
        print(f"  {name:<42} {value}   {RATIO_TARGETS.get(name, '')}".rstrip())
    met = {True: "yes", False: "NO", None: "skipped"}
    print("targets met: " + ", ".join(f"{k}: {met[v]}" for k, v in out["targets"].items()))
    print("retired targets: " + ", ".join(f"{k} ({why})" for k, why in out["retired_targets"].items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=40)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--executions", type=int, default=40)
    parser.add_argument("--baseline", type=int, default=20, help="calls per baseline workload")
    parser.add_argument(
        "--validations", type=int, default=3, help="validations of a game and of a tool example (0: none)"
    )
    parser.add_argument("--spares", type=int, default=IsolationSettings().spares, help="spare jails per zygote")
    parser.add_argument(
        "--cgroup",
        choices=["auto", "off"],
        default="auto",
        help="the pool's cgroup (its CPU weight is one process's: on a busy machine 'off' shows the jails "
        "competing as separate processes, as the baseline's interpreters do)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    load = [round(x, 2) for x in os.getloadavg()]
    out = {"load_average": load, **asyncio.run(measure(args))}
    if args.json:
        print(json.dumps(out))
    else:
        report(out)


if __name__ == "__main__":
    main()
