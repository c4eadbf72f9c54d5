"""The episode loop: one play of one env seed, turn by turn, through a sandbox session.

Game envs: each observation is a user turn (the first wrapped with the ``\\boxed{...}``
instructions and, in hinted plays, the hint); the last boxed command of each reply is the action.
Tool envs: the env's tools (``info["tools"]``) go to the chat template; each reply is one env step
(the env's base class runs every tool call in it), each call's result comes back as a ``tool``
message, and a new instruction (``info["new_instruction"]``) arrives as a new user turn.

Limits: the agent's budget (the run spec's turns per play, tokens per turn, total tokens per play).
The sandbox session is opened with the turn budget, so an env declaring more turns is clamped to it.
The return is the env's terminal reward (clamped to [0, 1]) when it terminates, else 0; the reason
is a ``spade.envs.types.FinishReason`` (one definition, sandbox -> rollout -> samples -> memory).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from spade.agent.pace import TurnPace
from spade.agent.ports import ChatTemplate, EnvSession, EnvSpec, Generator, SessionOpener, StepResult, TurnSampling
from spade.agent.prompts import first_game_message, with_hint
from spade.agent.trajectory import Trajectory, TrajectoryBuilder
from spade.envs.actions import normalize_game_action
from spade.envs.types import FinishReason, Outcome, Setting
from spade.sandbox.errors import SandboxFault
from spade.serving.logs import get_logger

log = get_logger(__name__)

TurnSeeds = Callable[[int], int]
"""``turn -> sampling_seed`` of one play (turns from 0)."""


@dataclass(frozen=True)
class PlayLimits:
    """Budgets of one play and the sampling of its turns.

    Attributes:
        max_turns: Model turns per play.
        max_tokens_per_turn: Tokens one turn may generate.
        max_total_tokens: Length cap of the whole trajectory (prompt, turns, observations).
        temperature: Sampling temperature.
        top_p: Nucleus mass.
        top_k: Top-k cut-off (-1: off).
    """

    max_turns: int = 8
    max_tokens_per_turn: int = 512
    max_total_tokens: int = 4096
    temperature: float = 0.6
    top_p: float = 1.0
    top_k: int = -1

    def __post_init__(self) -> None:
        if self.max_turns < 1 or self.max_tokens_per_turn < 1 or self.max_total_tokens < 2:
            raise ValueError(f"play limits must be positive, got {self}")


@dataclass
class Play:
    """One finished play.

    Attributes:
        env_id: The env played.
        seed: Its reset seed.
        hinted: Whether the hint was shown.
        trajectory: Token ids, logprobs, loss mask and weight versions.
        episode_return: Terminal reward, 0 unless terminated.
        turns: Model turns taken.
        finish_reason: How it ended.
        turn_cap: The session's turn limit: the env's own ``max_turns`` clamped to the agent's
            budget (0 when the sandbox did not say).
    """

    env_id: str
    seed: int
    hinted: bool
    trajectory: Trajectory
    episode_return: float
    turns: int
    finish_reason: FinishReason
    turn_cap: int = 0


def outcome_of(result: StepResult) -> Outcome:
    """The sandbox's verdict on a call as an ``Outcome`` (an unknown value is the env's error)."""
    value = getattr(result.outcome, "value", result.outcome)
    if not value:
        return Outcome.OK
    try:
        return Outcome(str(value))
    except ValueError:
        log.warning("the sandbox answered with an unknown outcome %r; counting it as the env's error", value)
        return Outcome.ENV_ERROR


def finish_for(result: StepResult, turn_budget: int) -> FinishReason | None:
    """How a call that did not answer normally ends the play (None: it answered; read its flags).

    ``limit`` is the session's turn cap. It is the agent's budget (``turn_limit``) when the cap is
    the budget — also when the env declared more turns and was clamped to it — and the env's own
    turn limit (``truncated``) when the env declared fewer turns than the budget.

    Raises:
        SandboxFault: The sandbox itself failed: the play is retried, never recorded as the env's.
    """
    outcome = outcome_of(result)
    if outcome is Outcome.OK:
        return None
    if outcome is Outcome.SANDBOX_FAULT:
        raise SandboxFault(f"the sandbox failed during a play: {result.observation[:200]!r}")
    if outcome is Outcome.LIMIT:
        cap = int(getattr(result, "max_turns", 0) or 0)
        return FinishReason.TRUNCATED if 0 < cap < turn_budget else FinishReason.TURN_LIMIT
    return FinishReason.for_outcome(outcome)


def _terminal_return(result: StepResult) -> float:
    reward = float(result.reward)
    if not math.isfinite(reward):
        return 0.0
    return min(1.0, max(0.0, reward))


class EpisodeRunner:
    """Plays env seeds with the current policy.

    Args:
        sessions: Opens sandbox sessions.
        generator: Generates model turns token-in/token-out.
        template: The policy's chat template and tokenizer.
        limits: Budgets and sampling.
        pace: Where each turn's gap (the env's last answer to the next ``step`` call) is recorded, for
            the audit plays (``core/pace.py``); a new one by default.
    """

    def __init__(
        self,
        sessions: SessionOpener,
        generator: Generator,
        template: ChatTemplate,
        limits: PlayLimits,
        pace: TurnPace | None = None,
    ) -> None:
        self._sessions = sessions
        self._generator = generator
        self._template = template
        self.limits = limits
        self.pace = pace if pace is not None else TurnPace()

    @property
    def sessions(self) -> SessionOpener:
        """The sandbox sessions the plays run in (the audit plays use the same)."""
        return self._sessions

    async def play(self, env: EnvSpec, seed: int, *, hinted: bool, turn_seeds: TurnSeeds | None = None) -> Play:
        """Play ``env`` from ``reset(seed)`` until it ends or a limit is hit.

        Args:
            env: The env's code, hint and setting.
            seed: Its reset seed.
            hinted: Show the hint with the first observation.
            turn_seeds: The ``sampling_seed`` of each model turn (None: unseeded sampling).

        Raises:
            SandboxFault: The sandbox (not the env) failed; the caller retries the play.
        """
        session = await self._sessions.open_session(env.code, env.setting, seed, agent_max_turns=self.limits.max_turns)
        try:
            return await self._play(session, env, seed, hinted, turn_seeds)
        finally:
            await session.close()

    async def _play(
        self, session: EnvSession, env: EnvSpec, seed: int, hinted: bool, turn_seeds: TurnSeeds | None
    ) -> Play:
        hint = env.hint if hinted else None
        initial = session.initial
        tool_env = env.setting == Setting.TOOL
        tools = initial.info.get("tools") if tool_env and isinstance(initial.info, Mapping) else None
        builder = TrajectoryBuilder(self._template, tools)
        cap = int(getattr(initial, "max_turns", 0) or 0)
        budget = self.limits.max_turns

        def done(reason: FinishReason, ret: float = 0.0, turns: int = 0) -> Play:
            return Play(env.env_id, seed, hinted, builder.trajectory, ret, turns, reason, cap)

        failure = finish_for(initial, budget)
        if failure is not None:
            return done(failure)
        first = first_game_message(initial.observation, hint) if not tool_env else with_hint(initial.observation, hint)
        builder.start([{"role": "user", "content": first}])
        limits = self.limits
        turns = 0
        answered = time.monotonic()  # the env's last answer: its reset, then each step
        while True:
            room = limits.max_total_tokens - len(builder.trajectory)
            if room <= 0:
                return done(FinishReason.TOKEN_LIMIT, turns=turns)
            sampling = TurnSampling(
                max_new_tokens=min(limits.max_tokens_per_turn, room),
                temperature=limits.temperature,
                top_p=limits.top_p,
                top_k=limits.top_k,
                seed=None if turn_seeds is None else turn_seeds(turns),
            )
            gen = await self._generator.generate(list(builder.trajectory.token_ids), sampling)
            cut = _finish_type(gen.finish_reason) == "length"
            builder.add_generation(gen.output_ids, gen.logprobs, gen.weight_version, cut=cut)
            turns += 1
            reply = self._template.decode_reply(gen.output_ids)
            self.pace.record(time.monotonic() - answered, env.env_id)
            step = await (self._tool_turn(session, reply) if tool_env else self._game_turn(session, reply))
            answered = time.monotonic()
            reason, ret, new_messages = step
            if reason is not None:
                return done(reason, ret, turns)
            if turns >= budget:
                return done(FinishReason.TURN_LIMIT, turns=turns)
            delta = builder.delta_ids(new_messages)
            if len(builder.trajectory) + len(delta) >= limits.max_total_tokens:
                return done(FinishReason.TOKEN_LIMIT, turns=turns)
            builder.add_delta(delta)

    async def _game_turn(
        self, session: EnvSession, reply: str
    ) -> tuple[FinishReason | None, float, list[dict[str, Any]]]:
        result = await session.step(normalize_game_action(reply))
        return step_ending(result, self.limits.max_turns) or (
            None,
            0.0,
            [{"role": "user", "content": result.observation}],
        )

    async def _tool_turn(
        self, session: EnvSession, reply: str
    ) -> tuple[FinishReason | None, float, list[dict[str, Any]]]:
        # The tool env parses and runs every call of the reply itself (it owns step()).
        result = await session.step(reply)
        ending = step_ending(result, self.limits.max_turns)
        if ending is not None:
            return ending
        return None, 0.0, tool_turn_messages(result)


def tool_turn_messages(result: StepResult) -> list[dict[str, Any]]:
    """The messages a tool env's step adds: one ``tool`` message per call, then a new instruction.

    A reply without a well-formed call gets the env's whole observation (its error or reminder)
    as a user turn.
    """
    info = result.info if isinstance(result.info, Mapping) else {}
    results = [r for r in info.get("tool_results") or [] if isinstance(r, Mapping)]
    if not results:
        return [{"role": "user", "content": result.observation}]
    messages: list[dict[str, Any]] = [
        {"role": "tool", "name": str(r.get("name", "")), "content": str(r.get("output", ""))} for r in results
    ]
    errors = [str(e) for e in info.get("errors") or []]
    instruction = info.get("new_instruction")
    notes = [f"Error: malformed tool call: {e}" for e in errors]
    if isinstance(instruction, str) and instruction:
        notes.append(instruction)
    if notes:
        messages.append({"role": "user", "content": "\n".join(notes)})
    return messages


def step_ending(result: StepResult, turn_budget: int) -> tuple[FinishReason, float, list[dict[str, Any]]] | None:
    """How a step's answer ends the play: (reason, return, no messages), or None when it goes on.

    Raises:
        SandboxFault: The sandbox itself failed (see :func:`finish_for`).
    """
    failure = finish_for(result, turn_budget)
    if failure is not None:
        return failure, 0.0, []
    if result.terminated:
        return FinishReason.TERMINATED, _terminal_return(result), []
    if result.truncated:
        return FinishReason.TRUNCATED, 0.0, []
    return None


def _finish_type(finish_reason: Any) -> str:
    """SGLang reports ``{"type": "stop"|"length"|"abort", ...}``; clients may flatten it to the type."""
    if isinstance(finish_reason, Mapping):
        return str(finish_reason.get("type", ""))
    return str(getattr(finish_reason, "value", finish_reason) or "")
