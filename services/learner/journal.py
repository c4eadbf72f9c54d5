"""The learner's sample journal: every received message, fsynced before it is acknowledged.

The learner acknowledges a queue message as soon as the message is durable in its own persisted
state, not at the next checkpoint (issue 15): otherwise the queue re-delivers every message still
pending after its claim interval, and ``count/duplicates`` grows with no real duplicate. The journal
is that state between checkpoints: an append-only log of segments in ``<checkpoint_dir>/journal/``.

- ``append`` writes a poll's messages (stream, message id, payload), flushes and fsyncs once; only
  then does the learner ``ack`` them.
- A checkpoint ``rotate``s to a new segment first and records its number (``journal_from``) in the
  checkpoint's state: the checkpoint holds everything before it.
- On start the learner restores the newest checkpoint and ``replay``s the segments from its
  ``journal_from``, then acknowledges the replayed ids again (a crash between the fsync and the ack
  leaves them pending; acknowledging twice is harmless). So after a crash the queue re-delivers only
  messages that never reached the journal.
- Segments no retained checkpoint needs are ``discard``ed.

Each record is ``>HHII`` (stream name length, message id length, payload length, CRC-32 of the
three fields) followed by the three fields. A torn tail (the process died mid-write) is detected by
its length or CRC and ends the replay of that segment; it was never acknowledged, so the queue
re-delivers it. A new process never appends to an old segment: it starts a fresh one.
"""

from __future__ import annotations

import os
import re
import struct
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from spade.serving.logs import get_logger

logger = get_logger(__name__)

_HEADER = struct.Struct(">HHII")
_SEGMENT = re.compile(r"^segment-(\d{8})\.log$")


@dataclass(frozen=True)
class JournalRecord:
    """One received queue message."""

    stream: str
    message_id: str
    payload: bytes


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def encode(record: JournalRecord) -> bytes:
    """The record's bytes in the journal.

    >>> r = JournalRecord("samples.agent", "1-0", b"x")
    >>> list(decode(encode(r) + encode(r)[:-1])) == [r]
    True
    """
    stream, mid = record.stream.encode(), record.message_id.encode()
    crc = zlib.crc32(record.payload, zlib.crc32(mid, zlib.crc32(stream)))
    return _HEADER.pack(len(stream), len(mid), len(record.payload), crc) + stream + mid + record.payload


def decode(data: bytes, where: str = "journal") -> Iterator[JournalRecord]:
    """The whole records of ``data``, stopping at a torn or corrupt tail (logged)."""
    pos = 0
    while pos < len(data):
        if pos + _HEADER.size > len(data):
            logger.warning("%s: torn record header at byte %d ignored (never acknowledged)", where, pos)
            return
        n_stream, n_mid, n_payload, crc = _HEADER.unpack_from(data, pos)
        start = pos + _HEADER.size
        end = start + n_stream + n_mid + n_payload
        if end > len(data):
            logger.warning("%s: torn record at byte %d ignored (never acknowledged)", where, pos)
            return
        stream = data[start : start + n_stream]
        mid = data[start + n_stream : start + n_stream + n_mid]
        payload = data[start + n_stream + n_mid : end]
        if zlib.crc32(payload, zlib.crc32(mid, zlib.crc32(stream))) != crc:
            logger.warning("%s: corrupt record at byte %d; the rest of the segment is ignored", where, pos)
            return
        yield JournalRecord(stream.decode(), mid.decode(), payload)
        pos = end


class SampleJournal:
    """Append-only, fsynced segments of received messages (see the module docstring).

    Args:
        directory: Where the segments live (created on demand).
    """

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        existing = self.segments()
        self._seq = (existing[-1] if existing else 0) + 1
        self._file: BinaryIO | None = None

    def segments(self) -> list[int]:
        """Numbers of the segments on disk, oldest first."""
        found = (_SEGMENT.match(p.name) for p in self.directory.iterdir())
        return sorted(int(m.group(1)) for m in found if m)

    def _path(self, seq: int) -> Path:
        return self.directory / f"segment-{seq:08d}.log"

    @property
    def position(self) -> int:
        """The segment new records go to (a checkpoint taken now replays from here)."""
        return self._seq

    def append(self, records: Iterable[JournalRecord]) -> int:
        """Write ``records`` and fsync them (one fsync for all); returns how many were written."""
        batch = list(records)
        data = b"".join(encode(r) for r in batch)
        if not data:
            return 0
        if self._file is None:
            created = not self._path(self._seq).exists()
            self._file = self._path(self._seq).open("ab")
            if created:
                _fsync_dir(self.directory)
        self._file.write(data)
        self._file.flush()
        os.fsync(self._file.fileno())
        return len(batch)

    def rotate(self) -> int:
        """Close the current segment and start the next; returns the new position."""
        if self._file is not None:
            self._file.close()
            self._file = None
        self._seq += 1
        return self._seq

    def replay(self, from_seq: int) -> Iterator[JournalRecord]:
        """Every record of the segments numbered ``from_seq`` and later, in order."""
        for seq in self.segments():
            if seq >= from_seq and seq != self._seq:
                path = self._path(seq)
                yield from decode(path.read_bytes(), str(path))

    def discard(self, before: int) -> int:
        """Delete the segments numbered below ``before``; returns how many."""
        gone = [seq for seq in self.segments() if seq < before and seq != self._seq]
        for seq in gone:
            self._path(seq).unlink(missing_ok=True)
        if gone:
            _fsync_dir(self.directory)
        return len(gone)

    def clear(self) -> None:
        """Delete every segment (a learner told not to resume starts from nothing)."""
        self.discard(self._seq + 1)

    def close(self) -> None:
        """Close the open segment."""
        if self._file is not None:
            self._file.close()
            self._file = None
