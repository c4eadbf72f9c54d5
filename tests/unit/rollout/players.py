"""Test doubles that cannot be the real thing in a fast unit test, kept honest.

``ScriptedPolicy`` replaces the LLM (a real model cannot be steered to a chosen reply): it emits
given replies as real token ids of the policy's tokenizer, with distinct logprobs so alignment is
checkable. ``LocalSessions`` runs trusted test env classes in this process with the contract library's own
result handling, so the scheduling tests stay fast; the real isolated pool and the sandbox's gRPC
``Play`` stream are exercised in ``tests/integration/rollout/test_sandbox_play.py`` and
``test_embedded_model.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from services.rollout.policy import FormatterTemplate, Generation
from spade.agent.ports import TurnSampling
from spade.envs import CheckConfig, Outcome, StepOutcome
from spade.envs.contract import unpack_reset, unpack_step


@dataclass
class ScriptedPolicy:
    """Replies with ``replies`` in order (cycling), ending each turn with the template's end token."""

    template: FormatterTemplate
    replies: Sequence[str]
    weight_version: int | None = 0
    end_token: str = "<|im_end|>"
    calls: list[tuple[list[int], TurnSampling]] = field(default_factory=list)
    versions: Callable[[int], int | None] | None = None

    async def generate(self, input_ids: list[int], sampling: TurnSampling) -> Generation:
        turn = len(self.calls)
        self.calls.append((list(input_ids), sampling))
        reply = self.replies[turn % len(self.replies)]
        ids = self.template.encode(reply + self.end_token)
        finish = "stop"
        if len(ids) > sampling.max_new_tokens:
            ids, finish = ids[: sampling.max_new_tokens], "length"
        logprobs = [-(turn + 1) - (i + 1) / 1000 for i in range(len(ids))]
        version = self.versions(turn) if self.versions else self.weight_version
        return Generation(output_ids=ids, logprobs=logprobs, finish_reason=finish, weight_version=version)


class LocalSession:
    def __init__(self, env: Any, seed: int, max_turns: int, faults: dict[int, Outcome] | None = None) -> None:
        self._env = env
        self._turn = 0
        self._max_turns = max_turns
        self._faults = faults or {}
        try:
            obs, info = unpack_reset(env.reset(seed=seed))
            self.initial = StepOutcome(obs, 0.0, False, False, info, 0, max_turns)
        except Exception as exc:
            self.initial = StepOutcome(f"reset failed: {exc}", 0.0, False, True, {}, 0, max_turns, Outcome.ENV_ERROR)
        self.closed = False

    async def step(self, action: str) -> StepOutcome:
        self._turn += 1
        if self._turn in self._faults:  # what the sandbox reports when the env's process hits a limit
            outcome = self._faults[self._turn]
            return StepOutcome(f"{outcome.value}", 0.0, False, True, {}, self._turn, self._max_turns, outcome)
        try:
            obs, reward, terminated, truncated, info = unpack_step(self._env.step(action))
        except Exception as exc:
            return StepOutcome(
                f"step failed: {exc}", 0.0, False, True, {}, self._turn, self._max_turns, Outcome.ENV_ERROR
            )
        if not (terminated or truncated) and self._turn >= self._max_turns:
            return StepOutcome(obs, 0.0, False, True, info, self._turn, self._max_turns, Outcome.LIMIT)
        return StepOutcome(obs, reward, terminated, truncated, info, self._turn, self._max_turns)

    async def close(self) -> None:
        self.closed = True


@dataclass
class LocalSessions:
    """Opens sessions on env classes registered by code string (no exec: the classes are test code).

    The session's turn cap is the contract's own: the env's ``max_turns`` clamped to the agent's
    budget (``CheckConfig.effective_max_turns``), as the sandbox does for ``agent_max_turns``.
    ``step_faults`` makes the sandbox report a resource fault at a given turn of every session.
    """

    classes: dict[str, type]
    max_turns: int = 25
    opened: list[tuple[str, str, int]] = field(default_factory=list)
    budgets: list[int] = field(default_factory=list)
    sessions: list[LocalSession] = field(default_factory=list)
    fault_on: set[int] = field(default_factory=set)
    step_faults: dict[int, Outcome] = field(default_factory=dict)

    async def open_session(self, code: str, setting: str, seed: int, *, agent_max_turns: int = 0) -> LocalSession:
        self.opened.append((code, setting, seed))
        self.budgets.append(agent_max_turns)
        checks = CheckConfig(max_turns_cap=agent_max_turns or self.max_turns, default_max_turns=self.max_turns)
        env_class = self.classes[code]
        cap = checks.effective_max_turns(getattr(env_class, "max_turns", None))
        session = LocalSession(env_class(), seed, cap, self.step_faults)
        if seed in self.fault_on:
            self.fault_on.discard(seed)
            session.initial = StepOutcome("worker died", 0.0, False, True, {}, 0, 0, Outcome.SANDBOX_FAULT)
        self.sessions.append(session)
        return session
