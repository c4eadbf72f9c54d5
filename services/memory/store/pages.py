"""Keyset pages and stored times: what every part of the SQL store shares.

Cursors are keyset positions (a row's ``seq``), opaque to callers, so rows stored while paging never
shift, repeat or hide later pages. Every time stored is UTC.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import TypeVar

from spade.memory.errors import InvalidArgument

T = TypeVar("T")

MAX_PAGE = 1000
"""Largest page a listing returns."""


def check_limit(limit: int) -> None:
    """Refuse a page size outside [1, MAX_PAGE].

    Raises:
        InvalidArgument: Names the limit and the bounds.
    """
    if not 1 <= limit <= MAX_PAGE:
        raise InvalidArgument(f"limit {limit} must be between 1 and {MAX_PAGE}")


def encode_cursor(seq: int) -> str:
    """Opaque cursor for the keyset position ``seq``."""
    return base64.urlsafe_b64encode(f"v1:{seq}".encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> int:
    """Inverse of ``encode_cursor``.

    Raises:
        InvalidArgument: The cursor was not issued by this service.
    """
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        tag, _, seq = raw.partition(":")
        if tag != "v1":
            raise ValueError(tag)
        return int(seq)
    except (ValueError, binascii.Error, UnicodeDecodeError):
        raise InvalidArgument(
            f"cursor {cursor[:40]!r} is not valid; pass back the next_cursor of a previous page unchanged"
        ) from None


def utc_now() -> datetime:
    """Now, in UTC."""
    return datetime.now(UTC)


def as_utc(t: datetime) -> datetime:
    """A stored time as an aware UTC datetime (SQLite returns naive datetimes for aware columns)."""
    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)


def first_of_each(items: Sequence[T], key: Callable[[T], str]) -> list[T]:
    """The first item of each key, in order: the rows one idempotent insert offers (the rest repeat them)."""
    seen: set[str] = set()
    first: list[T] = []
    for item in items:
        if key(item) not in seen:
            seen.add(key(item))
            first.append(item)
    return first
