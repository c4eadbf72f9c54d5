"""The sandbox's failure types, shared by the sandbox itself, its client and every caller.

Two kinds, because callers must treat them differently (STYLE habit 4):

- :class:`SandboxFault`: the sandbox failed, not the code it ran (a zygote died, a replica went
  away, a stream broke). The work is retried, never recorded as the code's result.
- :class:`SandboxRefused`: the sandbox answered and said no (a wrong key, a request over its
  limits). Retrying cannot help; the message says what to fix.
"""

from __future__ import annotations


class SandboxFault(RuntimeError):
    """The sandbox itself failed (not the env or program): retry elsewhere, never score it."""


class SandboxRefused(RuntimeError):
    """The sandbox refused the request (authentication, limits, a malformed request): do not retry."""
