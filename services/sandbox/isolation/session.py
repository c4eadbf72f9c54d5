"""``SandboxSession``: one env played turn by turn in its own jailed process.

The env's process runs ``spade.envs.EnvSession`` and answers on the env channel; the jail's pid 1
witnesses how that process ends and reports it on the control channel. Each call's outcome says
how it ended (``spade.envs.Outcome``):

- ``ok`` (read ``terminated``/``truncated``), ``env_error`` (the env raised or broke the contract),
  ``timeout`` (a call ran past its wall clock: the env's per-call limit or the service's
  ``step_seconds``), ``limit`` (the turn cap, counted by the service), ``memory_limit`` (the env's
  process ran out of memory): what the env's process may say about its own calls;
- ``cpu_limit`` and ``killed``: how the env's process died, from pid 1's report;
  ``output_limit``: a reply over ``observation_bytes``, measured by the service;
  ``sandbox_fault``: the sandbox failed (never taken from the env's channel).

Any outcome but ``ok`` ends the session: its processes are gone and further steps raise
``SessionEnded``. Whatever the env's process sends is checked here: an outcome it may not claim is
an ``env_error``, rewards are clamped to [0, 1] and the turn count is the service's own.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

from services.sandbox.isolation.channels import Channel
from services.sandbox.isolation.outcomes import ENV_CLAIMABLE, SandboxFault, classify_session_end
from services.sandbox.isolation.zygote import Spawned, Zygote
from services.sandbox.runtime.protocol import FrameTooLarge, ProtocolError
from spade.envs.types import Outcome, StepOutcome


class SessionEnded(RuntimeError):
    """A step was sent to a session whose process has already ended (closed or failed)."""


def ended_outcome(outcome: Outcome, message: str, last: StepOutcome | None) -> StepOutcome:
    """The outcome reported when a call did not produce one from the env (the episode is over)."""
    return StepOutcome(
        observation=message,
        reward=0.0,
        terminated=False,
        truncated=True,
        info={"error": message},
        turn=last.turn if last else 0,
        max_turns=last.max_turns if last else 0,
        outcome=outcome,
    )


class SandboxSession:
    """A live env session. Create with ``SandboxPool.open_session``; always ``await close()``.

    The session knows its owner only through two callbacks, so neither reaches into the other.

    Args:
        jail: The jailed process's context (exited on close).
        spawned: The spawned request (how the process ended, when it dies).
        zygote: The zygote that spawned it.
        channel: The env channel (the env's process on the other end).
        step_seconds: Wall-clock limit of one step.
        witness: The control channel (the jail's pid 1 on the other end).
        max_turns: The agent's turn budget: the step that reaches it without ending the episode is
            truncated with outcome ``limit``, whatever the env's process says.
        cpu_limit_s: The CPU-time rlimit of the env's process (to read pid 1's report).
        on_fault: Called once per sandbox fault the session process reports (the owner counts them).
        on_close: Called with the session once it has closed (the owner stops tracking it).

    Attributes:
        initial: the outcome of ``reset(seed)``.
    """

    def __init__(
        self,
        jail: AbstractAsyncContextManager[Any] | None,
        spawned: Spawned | None,
        zygote: Zygote | None,
        channel: Channel | None,
        step_seconds: float,
        *,
        witness: Channel | None = None,
        max_turns: int = 1000,
        cpu_limit_s: float = 0.0,
        on_fault: Callable[[], None] | None = None,
        on_close: Callable[[SandboxSession], None] | None = None,
    ) -> None:
        self._witness = witness
        self._max_turns = max_turns
        self._cpu_limit_s = cpu_limit_s
        self._turns = 0
        self._on_fault = on_fault
        self._on_close = on_close
        self._jail = jail
        self._spawned = spawned
        self._zygote = zygote
        self._channel = channel
        self._step_seconds = step_seconds
        self._lock = asyncio.Lock()
        self.initial: StepOutcome = ended_outcome(Outcome.SANDBOX_FAULT, "session not started", None)
        self.last: StepOutcome | None = None
        self.closed = False
        self.extras: dict[str, Any] = {}
        """The last outcome frame's other fields (``spade.envs.remote.SessionHost``: ``rng``, ``raw``,
        ``env``), as the env's process sent them: what the checker judges as the env's behaviour."""

    @classmethod
    def failed(cls, outcome: StepOutcome) -> SandboxSession:
        """A session that never got a process (its ``initial`` says why)."""
        session = cls(None, None, None, None, 0.0)
        session.initial = session.last = outcome
        session.closed = True
        return session

    @property
    def alive(self) -> bool:
        """Whether the session process still runs and accepts steps."""
        return not self.closed

    async def begin(self, request: dict[str, Any], timeout_s: float) -> None:
        """Send the code and seed; ``initial`` becomes the reset outcome."""
        assert self._channel is not None
        self.initial = await self._call(self._channel.send(request), timeout_s, "opening the session")

    async def step(self, action: str) -> StepOutcome:
        """Play ``action``; see the module docstring for the outcomes.

        Raises:
            SessionEnded: the session already ended.
        """
        async with self._lock:
            if self.closed or self._channel is None:
                raise SessionEnded("this session has ended (closed or failed): open a new session")
            self._turns += 1
            return await self._call(
                self._channel.send({"op": "step", "action": action}), self._step_seconds, "the step"
            )

    async def ask(self, message: dict[str, Any]) -> dict[str, Any]:
        """A validation's request other than a step (``spade.envs.remote.ASKS``) and the reply of the
        env's process (``value`` or ``raised``); if the session ends instead, ``{"op": "outcome",
        "outcome"}`` saying how, as for a step.

        Raises:
            SessionEnded: the session already ended.
        """
        async with self._lock:
            if self.closed or self._channel is None:
                raise SessionEnded("this session has ended (closed or failed): open a new session")
            answer: dict[str, Any] = {}
            outcome = await self._call(self._channel.send(message), self._step_seconds, "the request", answer)
            return answer or {"op": "outcome", "outcome": outcome.to_dict()}

    async def _call(
        self, send: Awaitable[None], timeout_s: float, what: str, answer: dict[str, Any] | None = None
    ) -> StepOutcome:
        """One request and its outcome; with ``answer``, a ``value``/``raised`` reply goes there instead."""
        assert self._channel is not None
        outcome: StepOutcome
        self.extras = {}
        try:
            async with asyncio.timeout(timeout_s):
                await send
                message = await self._channel.recv()
            if answer is not None and message is not None and message.get("op") in ("value", "raised"):
                answer.update(message)
                return self.last or self.initial
            outcome = await self._interpret(message)
        except TimeoutError:
            outcome = ended_outcome(
                Outcome.TIMEOUT, f"{what} ran past its wall-clock limit of {timeout_s:g} s", self.last
            )
        except asyncio.CancelledError:
            # A reply may still be on its way: the channel is out of step for good, so end it.
            await asyncio.shield(self.close())
            raise
        except FrameTooLarge as exc:
            outcome = ended_outcome(
                Outcome.OUTPUT_LIMIT, f"the env's reply was {exc.size} bytes, over the limit of {exc.limit}", self.last
            )
        except OSError:
            # The process went away under us (a broken pipe on send): ask the zygote how it ended.
            outcome = await self._died()
        except ProtocolError as exc:
            # Only the env's process writes on the env channel: garbage there is the env's doing.
            outcome = ended_outcome(
                Outcome.ENV_ERROR, f"the env's process broke the session protocol: {exc}", self.last
            )
        except (ValueError, TypeError, KeyError, AttributeError, OverflowError) as exc:
            # A frame of the right shape whose fields are not an outcome (StepOutcome.from_dict refused them).
            outcome = ended_outcome(
                Outcome.ENV_ERROR,
                f"the env produced an invalid outcome: {type(exc).__name__}: {str(exc)[:200]}",
                self.last,
            )
        self.last = outcome
        if outcome.outcome is not Outcome.OK:
            await self.close()
        return outcome

    async def _interpret(self, message: dict[str, Any] | None) -> StepOutcome:
        if message is None:
            return await self._died()
        op = message.get("op")
        self.extras = {k: v for k, v in message.items() if k not in ("op", "outcome", "error")}
        if op == "outcome":
            body = message.get("outcome")
            if not isinstance(body, dict):
                raise TypeError(f"'outcome' must be an object, got {type(body).__name__}")
            return self._checked(StepOutcome.from_dict(body))
        if op == "env_error":
            return ended_outcome(Outcome.ENV_ERROR, f"env error: {str(message.get('error'))[:500]}", self.last)
        return ended_outcome(
            Outcome.ENV_ERROR, f"the env's process sent {str(op)[:40]!r} instead of an outcome", self.last
        )

    def _checked(self, outcome: StepOutcome) -> StepOutcome:
        """The env's answer held to what the framework guarantees (the env's process could lie)."""
        if outcome.outcome not in ENV_CLAIMABLE:
            return ended_outcome(
                Outcome.ENV_ERROR, f"the env's process claimed outcome {outcome.outcome.value!r}", self.last
            )
        outcome.reward = min(max(outcome.reward, 0.0), 1.0)
        outcome.turn = self._turns
        outcome.max_turns = min(outcome.max_turns, self._max_turns) if outcome.max_turns > 0 else self._max_turns
        if outcome.outcome is Outcome.OK and not outcome.done and self._turns >= outcome.max_turns > 0:
            outcome.truncated, outcome.outcome = True, Outcome.LIMIT
        return outcome

    async def _died(self) -> StepOutcome:
        """The env's process closed its channel: pid 1's report says how it ended."""
        report: dict[str, Any] | None = None
        exited: dict[str, Any] | None = None
        if self._witness is not None:
            with contextlib.suppress(TimeoutError, OSError, ProtocolError):
                async with asyncio.timeout(5.0):
                    report = await self._witness.recv()
        if report is None and self._spawned is not None:
            try:
                async with asyncio.timeout(5.0):
                    exited = await asyncio.shield(self._spawned.exited)
            except (SandboxFault, TimeoutError):
                exited = None
        outcome, message = classify_session_end(report, exited, self._cpu_limit_s)
        if outcome is Outcome.SANDBOX_FAULT and self._on_fault is not None:
            self._on_fault()
        return ended_outcome(outcome, message, self.last)

    async def close(self) -> None:
        """End the session and its process (idempotent)."""
        if self.closed:
            return
        self.closed = True
        if self._channel is not None:
            with contextlib.suppress(Exception):
                await self._channel.send({"op": "close"})
        if self._witness is not None:
            self._witness.close()
        if self._jail is not None:
            await self._jail.__aexit__(None, None, None)
        if self._on_close is not None:
            self._on_close(self)
