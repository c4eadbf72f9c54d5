"""Audit plays: trivial policies on real rollout seeds, and the retire decision.

Validation can be gamed by behaviour: an env can play honestly on validation's seeds and let any
action win on others. The real path cannot be told apart from itself, so behind validation stand
audit plays (DESIGN §4). At an env's first window slot, beside its real plays, the rollout plays
``audit_plays`` episodes (the run spec's) of each trivial policy on the first seeds of that slot —
the seeds the real plays use, through the same kind of session, each turn waiting a real turn's gap
(``core/pace.py``) so an env that reads the clock cannot tell them apart — with no model call:

- ``noop``: the setting's constant do-nothing action (``spade.envs.policy.noop_action``);
- ``random``: a random action in the env's own stated format (``spade.envs.policy.RandomPolicy``:
  the ``\\boxed{...}`` commands its observation shows, the tools it declares, plain noise).

An env whose trivial policy reaches a win rate above ``audit_max_win_rate``
(``spade.signal.trivially_won``, per policy) is retired as ``trivially_won``: the worker keeps no
real play of slot 0 before the verdict, so its real plays are stopped and discarded and its window
closes, nothing it produced is trained on, and the learner scores its designer sample invalid.
Audit plays are never published as agent samples and never recorded as plays.

>>> plays = [AuditPlay(AuditPolicy.NOOP, 7, 1.0, 1, FinishReason.TERMINATED),
...          AuditPlay(AuditPolicy.RANDOM, 7, 0.0, 3, FinishReason.TRUNCATED)]
>>> verdict = decide("e", plays, max_win_rate=0.5)
>>> verdict.trivially_won, verdict.reason
(True, 'the noop policy returned 1.00 on average over its 1 audit plays on rollout seeds (above 0.50)')
>>> AuditVerdict.from_json(verdict.to_json()) == verdict
True
"""

from __future__ import annotations

import enum
import json
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from services.rollout.core.seeds import play_seeds
from spade.agent.episode import finish_for, step_ending
from spade.agent.pace import TurnPace
from spade.agent.ports import EnvSpec, SessionOpener
from spade.envs.actions import normalize_game_action
from spade.envs.policy import RandomPolicy, noop_action
from spade.envs.tool_env import normalize_tool
from spade.envs.types import FinishReason, Setting
from spade.signal import counted_return, trivially_won, win_rate


class AuditPolicy(enum.StrEnum):
    """The trivial policies of the audit."""

    NOOP = "noop"
    """The setting's constant do-nothing action, every turn."""
    RANDOM = "random"
    """A random action in the env's stated format, drawn afresh each turn."""


@dataclass(frozen=True)
class AuditPlay:
    """One audit play: a trivial policy on one real rollout seed (no tokens, never trained on)."""

    policy: AuditPolicy
    seed: int
    episode_return: float
    turns: int
    finish_reason: FinishReason

    # What ``spade.signal.counted_return`` reads: an audit play is an unhinted play of slot 0.
    hinted = False
    window_index = 0


@dataclass(frozen=True)
class PolicyResult:
    """One trivial policy's audit plays of an env: seeds and counted returns, in seed order."""

    policy: AuditPolicy
    seeds: tuple[int, ...]
    returns: tuple[float, ...]

    @property
    def win_rate(self) -> float:
        """``spade.signal.win_rate`` of the returns."""
        return win_rate(self.returns)


@dataclass(frozen=True)
class AuditVerdict:
    """The audit's decision on one env.

    Attributes:
        env_id: The env.
        results: Each trivial policy's plays.
        max_win_rate: The threshold it was decided under (the run spec's ``audit_max_win_rate``).
        trivially_won: A policy's win rate exceeded the threshold: the env is retired.
        reason: One sentence naming the policy, its wins and the threshold ("" when it passed).
    """

    env_id: str
    results: tuple[PolicyResult, ...]
    max_win_rate: float
    trivially_won: bool
    reason: str

    def to_json(self) -> str:
        """The stored form (``from_json`` restores it exactly)."""
        return json.dumps(
            {
                "env_id": self.env_id,
                "max_win_rate": self.max_win_rate,
                "trivially_won": self.trivially_won,
                "reason": self.reason,
                "results": [
                    {"policy": r.policy.value, "seeds": list(r.seeds), "returns": list(r.returns)} for r in self.results
                ],
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str) -> AuditVerdict:
        """Parse ``to_json`` output."""
        data: Mapping[str, Any] = json.loads(text)
        results = tuple(
            PolicyResult(AuditPolicy(r["policy"]), tuple(int(s) for s in r["seeds"]), tuple(map(float, r["returns"])))
            for r in data["results"]
        )
        return cls(
            str(data["env_id"]), results, float(data["max_win_rate"]), bool(data["trivially_won"]), data["reason"]
        )


def audit_seeds(env_id: str, plays: int) -> list[int]:
    """The seeds of each policy's audit plays: the first ``plays`` seeds of slot 0, the real plays' own."""
    return play_seeds(env_id, 0, plays)


def decide(env_id: str, plays: Sequence[AuditPlay], max_win_rate: float) -> AuditVerdict:
    """The retire decision over an env's audit plays: trivially won when any policy's win rate is too high.

    Raises:
        SignalError: A policy without plays, or ``max_win_rate`` outside [0, 1).
    """
    results = []
    for policy in AuditPolicy:
        mine = sorted((p for p in plays if p.policy is policy), key=lambda p: p.seed)
        if mine:
            results.append(PolicyResult(policy, tuple(p.seed for p in mine), tuple(counted_return(p) for p in mine)))
    won = [r for r in results if trivially_won(r.returns, max_win_rate)]
    reason = "; ".join(
        f"the {r.policy} policy returned {r.win_rate:.2f} on average over its {len(r.returns)} audit plays on "
        f"rollout seeds (above {max_win_rate:.2f})"
        for r in won
    )
    return AuditVerdict(env_id, tuple(results), max_win_rate, bool(won), reason)


def _tools(info: Any) -> dict[str, Any]:
    """The env's declared tools by name, from its reset ``info`` (what an agent is shown)."""
    tools: dict[str, Any] = {}
    declared = info.get("tools") if isinstance(info, Mapping) else None
    for declaration in declared if isinstance(declared, list) else []:
        try:
            tool = normalize_tool(declaration)
        except ValueError:
            continue
        if isinstance(tool.get("name"), str) and isinstance(tool.get("parameters"), dict):
            tools[tool["name"]] = tool
    return tools


class AuditPlayer:
    """Plays trivial policies through sandbox sessions, turn by turn, with no model.

    Args:
        sessions: Opens sandbox sessions (the same opener the real plays use).
        max_turns: The agent's turn budget (the session is opened with it, as for a real play).
        pace: The real plays' turn gaps: each audit turn waits one drawn from its env's own before it
            steps, so an env that times its calls cannot tell the audit from a real play (``core/pace.py``).
            ``None``: step at once (tests of the decision only).
    """

    def __init__(self, sessions: SessionOpener, max_turns: int, pace: TurnPace | None = None) -> None:
        self._sessions = sessions
        self.max_turns = max_turns
        self.pace = pace

    async def play(self, env: EnvSpec, seed: int, policy: AuditPolicy) -> AuditPlay:
        """One audit play of ``env`` from ``reset(seed)``; the random policy's draws depend on (env, seed) only.

        Raises:
            SandboxFault: The sandbox (not the env) failed; the caller retries the play.
        """
        session = await self._sessions.open_session(env.code, env.setting, seed, agent_max_turns=self.max_turns)
        try:
            initial = session.initial
            failure = finish_for(initial, self.max_turns)
            if failure is not None:
                return AuditPlay(policy, seed, 0.0, 0, failure)
            setting = Setting(env.setting)
            rng = random.Random(f"spade-audit\x00{env.env_id}\x00{seed}")
            chooser = RandomPolicy(setting, rng, [], _tools(initial.info))
            pacing = random.Random(f"spade-audit-pace\x00{env.env_id}\x00{seed}\x00{policy.value}")
            observation = initial.observation
            turns = 0
            while True:
                action = noop_action(setting) if policy is AuditPolicy.NOOP else chooser.action(observation)
                if self.pace is not None:
                    await self.pace.wait(pacing, env.env_id)  # the time a real turn of this env's takes
                if setting is Setting.GAME:
                    action = normalize_game_action(action)  # what the env gets from a real reply
                result = await session.step(action)
                turns += 1
                ending = step_ending(result, self.max_turns)
                if ending is not None:
                    return AuditPlay(policy, seed, ending[1], turns, ending[0])
                if turns >= self.max_turns:
                    return AuditPlay(policy, seed, 0.0, turns, FinishReason.TURN_LIMIT)
                observation = result.observation
        finally:
            await session.close()
