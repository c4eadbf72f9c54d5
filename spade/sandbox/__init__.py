"""Talking to the sandbox service: its one gRPC client, the wire translation and its domain types.

- ``spade.sandbox.client.SandboxClient``: every caller's client (env sessions for the rollout,
  ``Validate`` for the designer and ``spade envs seed``, ``Execute`` for other teams).
- ``spade.sandbox.wire``: proto messages to domain values and back (the server uses it too).
- ``spade.sandbox.errors`` and ``spade.sandbox.execution``: the domain types every side shares
  (``SandboxFault``, ``SandboxRefused``, ``ExecStatus``, ``ExecutionResult``).

Importing this package is light (no gRPC); the client module imports ``grpc`` itself.
"""

from spade.sandbox.errors import SandboxFault, SandboxRefused
from spade.sandbox.execution import ExecStatus, ExecutionResult

__all__ = ["ExecStatus", "ExecutionResult", "SandboxFault", "SandboxRefused"]
