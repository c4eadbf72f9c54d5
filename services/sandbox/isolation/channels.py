"""The service's end of a request's own channels: a framed control socket and capped pipes.

Everything here treats the other end as hostile: frames are bounded (``FrameTooLarge``), output is
cut at its cap, and nothing waits on the sandbox without the caller's timeout around it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
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


async def read_capped(fd: int, cap: int, overflow: asyncio.Event, data: bytearray) -> None:
    """Read a pipe to its end into ``data``, keeping at most ``cap`` bytes; set ``overflow`` past it.

    The caller owns (and closes) ``fd``; reading stops at the first byte over the cap. What was read
    stays in ``data`` even if the task is cancelled.
    """
    loop = asyncio.get_running_loop()
    os.set_blocking(fd, False)
    readable = asyncio.Event()
    loop.add_reader(fd, readable.set)
    try:
        while True:
            await readable.wait()
            readable.clear()
            try:
                chunk = os.read(fd, _CHUNK)
            except BlockingIOError:
                continue
            if not chunk:
                return
            data += chunk
            if len(data) > cap:
                overflow.set()
                del data[cap:]
                return
    finally:
        loop.remove_reader(fd)


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
