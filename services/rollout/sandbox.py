"""Env sessions for the episode loop from the sandbox's isolated pool, in-process (embedded mode).

In distributed mode the rollout plays through ``spade.sandbox.client.SandboxClient`` (one ``Play``
stream per session), which already is a ``SessionOpener``; this adapter gives the in-process pool
the same shape.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from spade.envs import CheckConfig


class _Pool(Protocol):
    async def open_session(self, code: str, setting: str, seed: int, config: CheckConfig) -> Any: ...


class PoolSessions:
    """The sandbox's isolated worker pool, used in-process (embedded mode).

    Args:
        pool: A started ``services.sandbox.isolation.SandboxPool``.
        checks: Limits sessions enforce (turn cap, observation size, call time).
    """

    def __init__(self, pool: _Pool, checks: CheckConfig | None = None) -> None:
        self._pool = pool
        self._checks = checks or CheckConfig()

    async def open_session(self, code: str, setting: str, seed: int, *, agent_max_turns: int = 0) -> Any:
        """Load ``code`` in a fresh jail and ``reset(seed)`` it.

        ``agent_max_turns``: the agent's turn budget; the session truncates there, and an env's own
        ``max_turns`` above it is clamped to it (as the sandbox service does for
        ``OpenSessionRequest.agent_max_turns``). 0: the configured checks.
        """
        return await self._pool.open_session(code, setting, seed, self._with_budget(agent_max_turns))

    def _with_budget(self, agent_max_turns: int) -> CheckConfig:
        if not agent_max_turns:
            return self._checks
        return dataclasses.replace(
            self._checks,
            max_turns_cap=agent_max_turns,
            default_max_turns=min(self._checks.default_max_turns, agent_max_turns),
        )
