"""The service's end of a request's own channels: a framed control socket and capped pipes.

Everything here treats the other end as hostile: frames are bounded (``FrameTooLarge``), output is
cut at its cap, and nothing waits on the sandbox without the caller's timeout around it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Callable
from typing import Any

from services.sandbox.runtime.protocol import MAX_FRAME, FrameDecoder, encode_frame

_CHUNK = 1 << 16


class Channel:
    """Length-prefixed JSON over one end of a request's socketpair (non-blocking, asyncio)."""

    def __init__(self, sock: socket.socket, max_frame: int = MAX_FRAME) -> None:
        sock.setblocking(False)
        self.sock = sock
        self._decoder = FrameDecoder(max_frame)
        self._backlog: list[dict[str, Any]] = []
        self._eof = False

    @classmethod
    async def open(cls, sock: socket.socket, max_frame: int = MAX_FRAME) -> Channel:
        return cls(sock, max_frame)

    @property
    def max_frame(self) -> int:
        return self._decoder.max_frame

    @max_frame.setter
    def max_frame(self, value: int) -> None:
        self._decoder.max_frame = value

    async def send(self, message: dict[str, Any]) -> None:
        await asyncio.get_running_loop().sock_sendall(self.sock, encode_frame(message))

    async def recv(self) -> dict[str, Any] | None:
        """The next message, or ``None`` once the other end has closed.

        Raises:
            FrameTooLarge: the peer announced a frame over ``max_frame``.
            ProtocolError: the peer sent something that is not a frame.
        """
        loop = asyncio.get_running_loop()
        while not self._backlog:
            if self._eof:
                return None
            data = await loop.sock_recv(self.sock, _CHUNK)
            if not data:
                self._eof = True
                continue
            self._backlog.extend(self._decoder.feed(data))
        return self._backlog.pop(0)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


class CappedReader:
    """A pipe read to its end by event-loop callbacks (no task of its own), keeping ``cap`` bytes.

    ``ended`` resolves at the end of file, or at the first byte over the cap: the bytes past it are
    dropped, ``overflowed`` is set and ``on_overflow`` called. The caller owns (and closes) ``fd``,
    after ``stop()``.
    """

    def __init__(self, fd: int, cap: int, on_overflow: Callable[[], None]) -> None:
        self._loop = asyncio.get_running_loop()
        self.fd = fd
        self.cap = cap
        self.data = bytearray()
        self.overflowed = False
        self.ended: asyncio.Future[None] = self._loop.create_future()
        self._on_overflow = on_overflow
        os.set_blocking(fd, False)
        self._loop.add_reader(fd, self._readable)

    def _readable(self) -> None:
        try:
            chunk = os.read(self.fd, _CHUNK)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""  # the pipe is unusable: its end as far as the program's output goes
        if not chunk:
            self.stop()
            return
        self.data += chunk
        if len(self.data) > self.cap:
            del self.data[self.cap :]
            self.overflowed = True
            self.stop()
            self._on_overflow()

    def stop(self) -> None:
        """Stop reading (idempotent); ``ended`` resolves."""
        if not self.ended.done():
            self._loop.remove_reader(self.fd)
            self.ended.set_result(None)


async def write_all(fd: int, data: bytes) -> None:
    """Write ``data`` to a pipe, then close it (the reader sees end of file). Owns ``fd``.

    A reader that exits early (broken pipe) simply ends the write; cancellation closes the pipe.
    """
    loop = asyncio.get_running_loop()
    try:
        os.set_blocking(fd, False)
        view = memoryview(data)
        writable = asyncio.Event()
        while view:
            try:
                written = os.write(fd, view[:_CHUNK])
                view = view[written:]
            except BlockingIOError:
                writable.clear()
                loop.add_writer(fd, writable.set)
                try:
                    await writable.wait()
                finally:
                    loop.remove_writer(fd)
            except (BrokenPipeError, ConnectionResetError):
                return
    finally:
        os.close(fd)
