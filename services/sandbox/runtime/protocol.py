"""Length-prefixed JSON frames: the only language spoken across the sandbox boundary.

A frame is a 4-byte big-endian length followed by that many bytes of UTF-8 JSON (one object).
Both sides bound the size they accept, so a hostile peer cannot make the other allocate without
limit. Standard library only: used inside the sandbox and by the service.

>>> decoder = FrameDecoder(max_frame=1024)
>>> decoder.feed(encode_frame({"op": "ping"}) + encode_frame({"op": "pong"})[:3])
[{'op': 'ping'}]
>>> decoder.feed(encode_frame({"op": "pong"})[3:])
[{'op': 'pong'}]
"""

from __future__ import annotations

import json
import re
import socket
import struct
from typing import Any

HEADER = struct.Struct(">I")
MAX_FRAME = 64 << 20
"""Default bound on one frame's body (bytes)."""
MEMORY_EXIT = 86
"""Exit code of a sandboxed process that stopped because it ran out of its memory limit."""


class ProtocolError(Exception):
    """The peer sent something that is not a frame of this protocol (or one that is too large)."""


class FrameTooLarge(ProtocolError):
    """A frame announced a body larger than the receiver accepts."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"frame of {size} bytes exceeds the limit of {limit} bytes")
        self.size = size
        self.limit = limit


def encode_frame(message: dict[str, Any]) -> bytes:
    """Serialise one message (a JSON object) as a frame."""
    body = json.dumps(message, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")
    if len(body) > 0xFFFFFFFF:
        raise FrameTooLarge(len(body), 0xFFFFFFFF)
    return HEADER.pack(len(body)) + body


MAX_DEPTH = 100
"""Deepest nesting of arrays and objects a frame body may have (the protocol's own messages use a
few levels, an env's ``info`` seldom more); deeper is a ``ProtocolError``, never a recursion."""


def _constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"{text[:20]} overflows a float")
    return value


def _check_shape(message: dict[str, Any]) -> None:
    """Refuse nesting deeper than ``MAX_DEPTH`` and text that is not Unicode (a lone surrogate escape).

    Iterative, so that no body can exhaust the stack of the process that reads it.
    """
    stack: list[tuple[Any, int]] = [(message, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise ProtocolError("frame body holds a lone surrogate (not Unicode text)") from None
            continue
        if isinstance(value, dict):
            children: Any = [*value.keys(), *value.values()]
        elif isinstance(value, list):
            children = value
        else:
            continue
        if depth > MAX_DEPTH:
            raise ProtocolError(f"frame body is nested deeper than {MAX_DEPTH} levels")
        stack.extend((child, depth + 1) for child in children)


def decode_body(body: bytes) -> dict[str, Any]:
    """Parse a frame body; anything but a JSON object of Unicode text, finite numbers and at most
    ``MAX_DEPTH`` levels is a protocol error (never any other exception, whatever the bytes)."""
    try:
        message = json.loads(body.decode("utf-8"), parse_constant=_constant, parse_float=_finite)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ProtocolError(f"frame body is not UTF-8 JSON ({exc.__class__.__name__}: {str(exc)[:80]})") from None
    if not isinstance(message, dict):
        raise ProtocolError(f"frame body must be a JSON object, got {type(message).__name__}")
    if _may_be_misshapen(body):
        _check_shape(message)
    return message


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _may_be_misshapen(body: bytes) -> bool:
    """Whether ``_check_shape`` could refuse ``body``: a cheap pre-filter for every step's frame, which
    may say yes for nothing (a ``\\u`` after an escaped backslash) but never no for a body it refuses.

    The body decoded as strict UTF-8, so a lone surrogate can only come from a ``\\uD800``-``\\uDFFF``
    escape; and no value nests deeper than the body has ``[`` and ``{`` (strings' included).
    """
    return body.count(b"[") + body.count(b"{") > MAX_DEPTH or _SURROGATE_ESCAPE.search(body) is not None


class FrameDecoder:
    """Incremental decoder: feed bytes as they arrive, get whole messages back.

    Args:
        max_frame: largest body accepted; a larger announced length raises ``FrameTooLarge``
            before any of the body is buffered.
    """

    def __init__(self, max_frame: int = MAX_FRAME) -> None:
        self.max_frame = max_frame
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        """Add ``data``; return every message completed by it, in order."""
        self._buffer += data
        messages = []
        while len(self._buffer) >= HEADER.size:
            (size,) = HEADER.unpack_from(self._buffer)
            if size > self.max_frame:
                raise FrameTooLarge(size, self.max_frame)
            end = HEADER.size + size
            if len(self._buffer) < end:
                break
            body = bytes(self._buffer[HEADER.size : end])
            del self._buffer[:end]
            messages.append(decode_body(body))
        return messages

    @property
    def pending(self) -> int:
        """Bytes buffered towards an incomplete frame."""
        return len(self._buffer)


def _recv_exactly(sock: socket.socket, size: int) -> bytes | None:
    chunks = bytearray()
    while len(chunks) < size:
        chunk = sock.recv(min(size - len(chunks), 1 << 20))
        if not chunk:
            if chunks:
                raise ProtocolError(f"connection closed inside a frame ({len(chunks)} of {size} bytes)")
            return None
        chunks += chunk
    return bytes(chunks)


def recv_frame(sock: socket.socket, max_frame: int = MAX_FRAME) -> dict[str, Any] | None:
    """Blocking read of one message from ``sock``; ``None`` on a clean end of stream."""
    header = _recv_exactly(sock, HEADER.size)
    if header is None:
        return None
    (size,) = HEADER.unpack(header)
    if size > max_frame:
        raise FrameTooLarge(size, max_frame)
    body = _recv_exactly(sock, size) if size else b""
    if body is None:
        raise ProtocolError("connection closed between a frame's header and its body")
    return decode_body(body)


def send_frame(sock: socket.socket, message: dict[str, Any]) -> None:
    """Blocking write of one message to ``sock``."""
    sock.sendall(encode_frame(message))
