"""The learner's buffer as it stands, written to ``<checkpoint_dir>/buffer.json`` for operators.

The learner journals and acknowledges every sample at once (``journal.py``), so the queue's
``samples.agent`` never shows pending work: what waits for a step is in the learner. After every poll
that received samples, and after every step, the learner writes this small record (atomically,
without fsync: it is a report, not state; the journal is the state), and ``spade cluster status``
reads it. Standard library only, so a reader needs no torch.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

BUFFER_FILE = "buffer.json"
"""The record's name in the learner's ``checkpoint_dir``."""


@dataclass(frozen=True)
class LearnerBuffer:
    """What the learner holds toward its next step.

    Attributes:
        version: The weight version the learner is at (its next step trains version + 1).
        spec_id: The run spec.
        plays_buffered: Agent plays held, in complete and incomplete groups.
        groups_complete: Groups holding G plays.
        groups_per_step: Complete groups a step waits for (``agent_groups_per_step``).
        group_size: G, plays per group (the run spec).
        designer_waiting: Designer samples waiting for their env's window to close.
        updated_at: When it was written (Unix time).
    """

    version: int
    spec_id: str
    plays_buffered: int
    groups_complete: int
    groups_per_step: int
    group_size: int
    designer_waiting: int
    updated_at: float

    @property
    def plays_per_step(self) -> int:
        """Plays a step needs: ``groups_per_step`` complete groups of G."""
        return self.groups_per_step * self.group_size

    def to_json(self) -> dict[str, Any]:
        """The record's fields, with ``plays_per_step``."""
        return {**asdict(self), "plays_per_step": self.plays_per_step}


def write_buffer(checkpoint_dir: Path, buffer: LearnerBuffer) -> None:
    """Replace ``checkpoint_dir/buffer.json`` (a rename: a reader never sees half a record)."""
    path = Path(checkpoint_dir) / BUFFER_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{BUFFER_FILE}.{os.getpid()}")
    tmp.write_text(json.dumps(asdict(buffer)))
    os.replace(tmp, path)


ANNOUNCED_FILE = "published.json"
"""``<checkpoint_dir>/published.json``: the newest version whose publication completed (workers + announcement)."""


def read_announced(checkpoint_dir: Path) -> int:
    """The newest version the learner announced (0: none yet); the learner and ``spade cluster status`` read it."""
    path = Path(checkpoint_dir) / ANNOUNCED_FILE
    return int(json.loads(path.read_text())["version"]) if path.is_file() else 0


def read_buffer(checkpoint_dir: Path) -> LearnerBuffer | None:
    """The last record the learner wrote, or ``None`` (no learner has polled yet, or it is unreadable)."""
    path = Path(checkpoint_dir) / BUFFER_FILE
    try:
        data = json.loads(path.read_text())
        fields = {k: data[k] for k in LearnerBuffer.__dataclass_fields__}
        return LearnerBuffer(**fields)
    except (OSError, ValueError, KeyError, TypeError):
        return None
