"""The sample journal: what is appended is replayed, torn tails are ignored, old segments go."""

from __future__ import annotations

from pathlib import Path

from services.learner.journal import JournalRecord, SampleJournal, encode


def records(n: int, prefix: str = "m") -> list[JournalRecord]:
    return [
        JournalRecord("samples.agent", f"{prefix}{i}-0", f"payload {prefix}{i}".encode() * (i + 1)) for i in range(n)
    ]


def test_appended_records_replay_in_order_across_segments_and_processes(tmp_path: Path) -> None:
    journal = SampleJournal(tmp_path)
    assert journal.append(records(3, "a")) == 3
    assert journal.rotate() == 2
    journal.append(records(2, "b"))
    journal.close()
    # A new process replays everything and writes to a fresh segment, never after an old tail.
    again = SampleJournal(tmp_path)
    assert again.position == 3
    assert list(again.replay(0)) == records(3, "a") + records(2, "b")
    assert list(again.replay(2)) == records(2, "b")


def test_a_torn_or_corrupt_tail_ends_the_segment_without_losing_what_came_before(tmp_path: Path) -> None:
    journal = SampleJournal(tmp_path)
    journal.append(records(2))
    journal.close()
    segment = tmp_path / "segment-00000001.log"
    whole = segment.read_bytes()
    torn = encode(JournalRecord("samples.agent", "x-0", b"never acknowledged"))
    segment.write_bytes(whole + torn[: len(torn) - 3])
    assert list(SampleJournal(tmp_path).replay(0)) == records(2)
    flipped = bytearray(whole)
    flipped[-1] ^= 0xFF  # the last record's payload no longer matches its CRC
    segment.write_bytes(bytes(flipped))
    assert list(SampleJournal(tmp_path).replay(0)) == records(1)


def test_discard_keeps_what_a_checkpoint_still_needs(tmp_path: Path) -> None:
    journal = SampleJournal(tmp_path)
    for i in range(3):
        journal.append(records(1, f"s{i}"))
        journal.rotate()
    assert journal.segments() == [1, 2, 3]
    assert journal.discard(3) == 2
    assert list(journal.replay(0)) == records(1, "s2")
    journal.clear()
    assert journal.segments() == []
