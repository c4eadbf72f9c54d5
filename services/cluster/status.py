"""``spade cluster status``: what a running cluster is doing, each figure read where it is durable.

Each section says where it comes from (docs/distributed.md, "What `spade cluster status` shows"):

- ``members``: each process's pid (the runner's ``state.json``) and health (its health check);
- ``weights``: the current published version and when it was published, from the learner's
  ``<weights_dir>/latest`` pointer (it moves before any inference server is told, and never goes
  back), with the version the learner last announced (``<checkpoint_dir>/published.json``). Not the
  ``weights.published`` stream: entries every group acknowledged are deleted, so its length is 0;
- ``learner``: its buffer against its step size, from the record it writes after every poll
  (``services/learner/buffer.py``). The learner journals and acknowledges each sample at once, so
  ``samples.agent``'s pending stays 0 while plays wait in the learner;
- ``streams``: each stream's key exactly as ``redis-cli`` needs it, its length, and per consumer
  group the pending (delivered, not yet acknowledged) and lag (not yet delivered) that
  ``XINFO GROUPS`` reports;
- ``activity``: plays per minute and designer validity over the last ``window_min`` minutes, from
  the plays and designer attempts the memory stored (validity as ``attempt_stats`` defines it);
- ``rollout``: each worker's leased slots (env, slot, seconds until the lease lapses), from the
  rollout's state tables; a lease past its time belongs to a worker that died and is taken over;
- ``disk``: bytes on disk under the data directory, by part (checkpoints, journal, weights, logs).

A source that does not answer gives its section an ``error`` (or a ``note``) instead of failing the rest.
"""

from __future__ import annotations

import datetime as dt
import os
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spade.dependencies import DependencyUnavailable
from spade.queues.base import STREAMS

if TYPE_CHECKING:
    from services.cluster.runner import Cluster

DEFAULT_WINDOW_MIN = 10.0
"""Minutes the activity figures cover by default."""

DB_TIMEOUT_S = 5
"""Longest wait for Postgres or Redis: status answers even when one is down."""


def _iso(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _section(read: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``read()``, or its failure as ``{"error": ...}`` (one source down leaves the others)."""
    try:
        return read()
    except Exception as exc:
        cause = getattr(exc, "orig", None) or exc  # a database error: the driver's own words
        lines = str(cause).strip().splitlines()
        return {"error": f"{type(cause).__name__}: {lines[0] if lines else ''}"}


def plays_per_minute(plays: int, minutes: float) -> float:
    """Plays recorded per minute over a window of ``minutes``.

    >>> plays_per_minute(30, 10.0)
    3.0
    """
    return round(plays / minutes, 2) if minutes > 0 else 0.0


class StatusReader:
    """Reads a cluster's figures from the places the services keep them (see the module docstring).

    Args:
        env: Every process's environment (``Cluster.env()``): the paths, URLs and prefix come from it.
        run_dir: The runner's directory (logs, ``state.json``).
        clock: Unix time (tests pass their own).
    """

    def __init__(self, env: Mapping[str, str], run_dir: Path, clock: Callable[[], float] = time.time) -> None:
        self.env = dict(env)
        self.run_dir = Path(run_dir)
        self.clock = clock
        data = env.get("SPADE_LOCAL_DATA_DIR")
        self.data_dir = Path(data) if data else self.run_dir
        self.checkpoint_dir = Path(env.get("SPADE_LEARNER_CHECKPOINT_DIR", str(self.data_dir / "learner/checkpoints")))
        self.weights_dir = Path(env.get("SPADE_LEARNER_WEIGHTS_DIR", str(self.data_dir / "learner/weights")))

    # -- files ---------------------------------------------------------------------------------------

    def weights(self) -> dict[str, Any]:
        """The published version (``<weights_dir>/latest``), when it was published, the last announced one."""
        from services.learner.buffer import read_announced
        from spade.inference.published import LATEST, published_version

        link = self.weights_dir / LATEST
        version = published_version(self.weights_dir)
        out: dict[str, Any] = {"version": version, "published_at": None, "age_s": None, "source": str(link)}
        if version > 0:
            at = link.lstat().st_mtime  # the pointer is replaced (renamed over) at each publication
            out["published_at"] = _iso(at)
            out["age_s"] = round(self.clock() - at, 1)
        out["announced"] = read_announced(self.checkpoint_dir)
        if version == 0:
            out["note"] = "no version published yet (the base model serves)"
        elif out["announced"] < version:
            out["note"] = f"v{version} is written and pointed at; its announcement is still to come"
        return out

    def learner(self) -> dict[str, Any]:
        """The learner's buffer record, with its age."""
        from services.learner.buffer import BUFFER_FILE, read_buffer

        buffer = read_buffer(self.checkpoint_dir)
        if buffer is None:
            return {"note": f"no buffer record yet ({self.checkpoint_dir / BUFFER_FILE}): the learner has not polled"}
        return {**buffer.to_json(), "age_s": round(self.clock() - buffer.updated_at, 1)}

    def disk(self) -> dict[str, Any]:
        """Bytes on disk under the data directory, by part.

        A file is counted once, in the first part that holds it: the journal, then the published
        weights, then the checkpoints (a checkpoint hard-links the model files of the version published
        at its step, so ``checkpoints`` is mostly optimizer state), then the logs, then anything else.
        """
        seen: set[tuple[int, int]] = set()
        parts = {
            "journal": self.checkpoint_dir / "journal",
            "weights": self.weights_dir,
            "checkpoints": self.checkpoint_dir,
            "logs": self.run_dir / "logs",
        }
        sizes = {name: _disk_bytes(path, seen) for name, path in parts.items()}
        total = _disk_bytes(self.data_dir, seen)  # what is left: the rest of the data dir
        outside = [str(p) for p in parts.values() if not _inside(p, self.data_dir)]
        out: dict[str, Any] = {
            "data_dir": str(self.data_dir),
            "bytes": sum(sizes.values()) + total,
            "parts": {**sizes, "other": total},
        }
        if outside:
            out["outside_data_dir"] = outside
        return out

    # -- stores --------------------------------------------------------------------------------------

    def streams(self) -> dict[str, Any]:
        """Each stream: its key as redis-cli needs it, length, and per group XINFO GROUPS' pending and lag."""
        import redis

        from services.cluster.runner import Cluster
        from spade.queues.redis_streams import stream_key

        queue = Cluster.queue_config(self.env)
        client = redis.Redis.from_url(queue["url"], socket_timeout=DB_TIMEOUT_S, socket_connect_timeout=DB_TIMEOUT_S)
        out: dict[str, Any] = {}
        try:
            for stream in STREAMS:
                key = stream_key(queue.get("prefix", "spade:"), stream)
                exists = bool(client.exists(key))
                groups = client.xinfo_groups(key) if exists else []
                out[stream] = {
                    "key": key,
                    "length": int(client.xlen(key)) if exists else 0,
                    "groups": {
                        _text(g["name"]): {
                            "consumers": int(g["consumers"]),
                            "pending": int(g["pending"]),
                            "lag": None if g.get("lag") is None else int(g["lag"]),
                        }
                        for g in groups
                    },
                }
        finally:
            client.close()
        return out

    def activity(self, window_min: float) -> dict[str, Any]:
        """Plays per minute and designer validity over the last ``window_min`` minutes (the memory's rows)."""
        import sqlalchemy as sa
        from sqlalchemy.orm import Session

        from services.memory.store.models import PlayRow
        from services.memory.store.pool_stats import attempt_stats

        engine = self._engine("SPADE_MEMORY_DATABASE_URL")
        try:
            with Session(engine) as s:
                since = dt.datetime.fromtimestamp(self.clock(), dt.UTC) - dt.timedelta(minutes=window_min)
                plays = int(s.scalar(sa.select(sa.func.count()).where(PlayRow.played_at >= since)) or 0)
                attempts = attempt_stats(s, since=since)
        finally:
            engine.dispose()
        return {
            "window_min": window_min,
            "plays": plays,
            "plays_per_minute": plays_per_minute(plays, window_min),
            "designer_attempts": attempts.attempts,
            "designer_valid": attempts.valid,
            "designer_validity": attempts.validity_rate,
            "designer_outcomes": attempts.by_outcome,
        }

    def rollout(self, workers: list[str]) -> dict[str, Any]:
        """Each worker's leased slots (``workers`` listed even with none; other lease holders too)."""
        from services.rollout.state_store import RolloutStateStore
        from spade.retry import RetryPolicy

        engine = self._engine("SPADE_ROLLOUT_STATE_URL")
        try:
            store = RolloutStateStore(engine, wait=RetryPolicy(attempts=1, initial_s=0.0, max_s=0.0), create=False)
            held = store.held_slots()
        finally:
            engine.dispose()
        out: dict[str, Any] = {name: {"slots": []} for name in workers}
        for h in held:
            slot = {"env_id": h.env_id, "slot": h.slot, "lease_expires_in_s": h.expires_in_s, "attempts": h.attempts}
            if h.expires_in_s < 0:
                slot["note"] = "lease lapsed: any worker takes it over"
            out.setdefault(h.owner, {"slots": []})["slots"].append(slot)
        return out

    def _engine(self, variable: str) -> Any:
        import sqlalchemy as sa

        url = self.env.get(variable)  # never another service's database: a report must not guess
        if not url:
            raise DependencyUnavailable(f"{variable} is not set")
        if not url.startswith("postgresql"):
            return sa.create_engine(url)
        # A query waits DB_TIMEOUT_S at most too (a lock, a stalled server): the report still comes. The
        # URL's own options (a search path, say) are kept: connect_args would replace them.
        own = sa.engine.make_url(url).query.get("options", "")
        options = " ".join([*([own] if isinstance(own, str) else own), f"-c statement_timeout={DB_TIMEOUT_S * 1000}"])
        return sa.create_engine(url, connect_args={"connect_timeout": DB_TIMEOUT_S, "options": options.strip()})

    # -- all -----------------------------------------------------------------------------------------

    def report(self, workers: list[str], window_min: float = DEFAULT_WINDOW_MIN) -> dict[str, Any]:
        """Every section but ``members`` (the runner adds those)."""
        return {
            "at": _iso(self.clock()),
            "weights": _section(self.weights),
            "learner": _section(self.learner),
            "streams": _section(self.streams),
            "activity": _section(lambda: self.activity(window_min)),
            "rollout": _section(lambda: self.rollout(workers)),
            "disk": _section(self.disk),
        }


def collect(cluster: Cluster, window_min: float = DEFAULT_WINDOW_MIN) -> dict[str, Any]:
    """The whole status of ``cluster``: its members, then :meth:`StatusReader.report`."""
    members: dict[str, Any] = {}
    workers = []
    for member in cluster.members():
        pid = cluster.pid(member.name)
        health = "down"
        if pid is not None:
            health = "up"
            if member.health is not None:
                try:
                    member.health()
                except (DependencyUnavailable, OSError) as exc:
                    health = f"unhealthy: {exc}"
        members[member.name] = {"pid": pid, "health": health}
        if member.role == "rollout":
            workers.append(member.name)
    reader = StatusReader(cluster.env(), cluster.run_dir)
    return {"members": members, **reader.report(workers, window_min)}


# -- text --------------------------------------------------------------------------------------------


def render(report: Mapping[str, Any]) -> Iterator[str]:
    """The report as the lines of ``spade cluster status`` (``--json`` prints the report itself)."""
    yield f"spade cluster status at {report['at']}"
    for name, m in report["members"].items():
        yield f"  {name:<12} {m['pid'] or '-':>8}  {m['health']}"
    yield ""
    yield f"weights     {_or_error(report['weights'], _weights_line)}"
    yield f"learner     {_or_error(report['learner'], _learner_line)}"
    yield f"activity    {_or_error(report['activity'], _activity_line)}"
    yield ""
    streams = report["streams"]
    if "error" in streams:
        yield f"streams     {streams['error']}"
    else:
        yield f"  {'stream key (quote it for redis-cli)':<36} {'length':>6}  group: pending/lag"
        for stream in streams.values():
            groups = ", ".join(f"{g}: {v['pending']}/{_dash(v['lag'])}" for g, v in stream["groups"].items())
            yield f"  {stream['key']:<36} {stream['length']:>6}  {groups or '(no group yet)'}"
    yield ""
    rollout = report["rollout"]
    if "error" in rollout:
        yield f"rollout     {rollout['error']}"
    else:
        for name, worker in rollout.items():
            yield f"  {name:<12} {'; '.join(_slot(x) for x in worker['slots']) or 'no slot leased'}"
    yield ""
    disk = report["disk"]
    if "error" in disk:
        yield f"disk        {disk['error']}"
    else:
        parts = ", ".join(f"{k} {_size(v)}" for k, v in disk["parts"].items() if v)
        yield f"disk        {_size(disk['bytes'])} under {disk['data_dir']}" + (f" ({parts})" if parts else "")
        if disk.get("outside_data_dir"):
            yield f"            also written outside it: {', '.join(disk['outside_data_dir'])}"


def _or_error(section: Mapping[str, Any], line: Callable[[Mapping[str, Any]], str]) -> str:
    """The section's error, or its note when that is all it has, else ``line(section)``."""
    if "error" in section:
        return str(section["error"])
    if set(section) == {"note"}:
        return str(section["note"])
    return line(section)


def _weights_line(w: Mapping[str, Any]) -> str:
    if w["version"] == 0:
        return f"v0: {w['note']}"
    return f"v{w['version']} published {w['published_at']} ({_ago(w['age_s'])} ago), announced v{w['announced']}"


def _learner_line(b: Mapping[str, Any]) -> str:
    return (
        f"at v{b['version']}: {b['plays_buffered']} plays buffered toward {b['plays_per_step']} a step "
        f"({b['groups_complete']}/{b['groups_per_step']} groups of G={b['group_size']} complete), "
        f"{b['designer_waiting']} designer samples waiting for their windows; as of {_ago(b['age_s'])} ago"
    )


def _activity_line(a: Mapping[str, Any]) -> str:
    validity = "-" if a["designer_validity"] is None else f"{a['designer_validity']:.0%}"
    return (
        f"last {a['window_min']:g} min: {a['plays']} plays ({a['plays_per_minute']:g}/min), "
        f"designer {a['designer_valid']}/{a['designer_attempts']} valid ({validity})"
    )


def _slot(x: Mapping[str, Any]) -> str:
    left = x["lease_expires_in_s"]
    lease = "lapsed: any worker takes it over" if left < 0 else f"{left:g} s left"
    return f"{x['env_id']} slot {x['slot']} (lease {lease})"


def _dash(value: Any) -> str:
    return "-" if value is None else str(value)


def _ago(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _size(n: int) -> str:
    """``n`` bytes for a person.

    >>> _size(512), _size(3 * 1024**2), _size(5 * 1024**3)
    ('512 B', '3.0 MB', '5.0 GB')
    """
    value = float(n)
    for unit in ("B", "KB", "MB"):
        if value < 1024:
            return f"{value:.0f} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GB"


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _inside(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root.resolve())
    except ValueError:
        return False
    return True


def _disk_bytes(root: Path, seen: set[tuple[int, int]]) -> int:
    """Bytes on disk of the files under ``root`` not counted yet (``seen``: device and inode), as ``du``."""
    total = 0
    stack = [root]
    while stack:
        here = stack.pop()
        try:
            entries = list(os.scandir(here))
        except OSError:
            continue
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if entry.is_dir(follow_symlinks=False):
                stack.append(Path(entry.path))
                continue
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
    return total
