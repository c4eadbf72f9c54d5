"""The service's own repairs of env code: what a session loads is decided here, never in a jail.

Validation and sessions both load the code that ``spade.envs.repair_code`` makes of what the caller
sent. The service computes it itself (a jail's answer could name other code) and remembers it by
the SHA-256 of the code as sent and as repaired, so sessions of known code skip the repairs. Code
the cheap test (``needs_repair``) finds nothing to repair in is sent as it is: the jail compiles it
and repairs it only if it does not compile, which gives the same code as ``repair_code``.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from dataclasses import dataclass

from spade.envs.repair import needs_repair, repair_code

REPAIR_CACHE_SIZE = 4096
"""Codes whose repaired form the service remembers (two digests each)."""
INLINE_BYTES = 4 << 10
"""Code up to this size is repaired on the event loop (about a millisecond at most); larger in a thread."""


def digest(code: str) -> str:
    """The SHA-256 hex digest of ``code`` (UTF-8)."""
    return hashlib.sha256(code.encode("utf-8", "surrogatepass")).hexdigest()


@dataclass(frozen=True)
class Prepared:
    """The code a jail gets for a caller's code.

    Attributes:
        code: what to load.
        repaired: True when ``code`` is the output of ``repair_code`` (the jail loads it as it is);
            False when the cheap test found nothing to repair (the jail repairs it only if it does
            not compile).
    """

    code: str
    repaired: bool


class Repairs:
    """Repaired code by digest, least recently used first out."""

    def __init__(self, size: int = REPAIR_CACHE_SIZE) -> None:
        self.size = size
        self._known: OrderedDict[str, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._known)

    def remember(self, code: str, repaired: str) -> None:
        """Map ``code`` and ``repaired`` to ``repaired``."""
        for key in (digest(code), digest(repaired)):
            self._known[key] = repaired
            self._known.move_to_end(key)
        while len(self._known) > self.size:
            self._known.popitem(last=False)

    def known(self, code: str) -> str | None:
        found = self._known.get(digest(code))
        if found is not None:
            self._known.move_to_end(digest(code))
        return found

    async def repaired(self, code: str) -> str:
        """``repair_code(code)``'s code, computed here (off the event loop when large) and remembered."""
        found = self.known(code)
        if found is not None:
            return found
        if len(code) <= INLINE_BYTES:
            repaired, _ = repair_code(code)
        else:
            repaired, _ = await asyncio.to_thread(repair_code, code)
        self.remember(code, repaired)
        return repaired

    async def prepare(self, code: str) -> Prepared:
        """What a session's jail loads for ``code`` (see the module docstring)."""
        found = self.known(code)
        if found is not None:
            return Prepared(found, True)
        if not needs_repair(code):
            return Prepared(code, False)
        return Prepared(await self.repaired(code), True)
