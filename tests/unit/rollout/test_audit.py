"""The audit's retire decision and its trivial policies (no model: the plays run through test sessions)."""

from __future__ import annotations

import inspect
from typing import Any, ClassVar

import pytest

from services.rollout.core.audit import (
    AuditPlay,
    AuditPlayer,
    AuditPolicy,
    AuditVerdict,
    audit_seeds,
    decide,
)
from services.rollout.core.seeds import play_seeds
from spade.agent.ports import EnvSpec
from spade.envs.types import FinishReason, Outcome
from spade.signal import SignalError
from tests.unit.rollout.envs import CountdownEnv, ForgingEnv, NotesEnv
from tests.unit.rollout.players import LocalSessions


def _play(policy: AuditPolicy, ret: float, seed: int = 1, finish: FinishReason = FinishReason.TERMINATED) -> AuditPlay:
    return AuditPlay(policy, seed, ret, 1, finish)


# ---- the retire decision ----------------------------------------------------------------------------


def test_a_trivial_policy_above_the_threshold_retires_the_env_and_the_reason_names_it() -> None:
    verdict = decide("e", [_play(AuditPolicy.NOOP, 0.0), _play(AuditPolicy.RANDOM, 1.0)], max_win_rate=0.5)
    assert verdict.trivially_won
    assert verdict.reason == (
        "the random policy returned 1.00 on average over its 1 audit plays on rollout seeds (above 0.50)"
    )
    assert [r.policy for r in verdict.results] == [AuditPolicy.NOOP, AuditPolicy.RANDOM]


def test_at_or_below_the_threshold_the_env_passes_with_no_reason() -> None:
    plays = [_play(AuditPolicy.NOOP, 1.0, 1), _play(AuditPolicy.NOOP, 0.0, 2), _play(AuditPolicy.RANDOM, 0.0, 1)]
    verdict = decide("e", plays, max_win_rate=0.5)  # noop: 0.5, not above 0.5
    assert not verdict.trivially_won and verdict.reason == ""


def test_each_policy_is_judged_on_its_own_plays_never_pooled() -> None:
    # Pooled, 2 wins of 4 would be 0.5; the noop policy alone wins 2 of 2.
    plays = [_play(AuditPolicy.NOOP, 1.0, s) for s in (1, 2)] + [_play(AuditPolicy.RANDOM, 0.0, s) for s in (1, 2)]
    verdict = decide("e", plays, max_win_rate=0.5)
    assert verdict.trivially_won and verdict.reason.startswith(
        "the noop policy returned 1.00 on average over its 2 audit plays"
    )


def test_partial_rewards_count_as_the_win_rate_defines_them() -> None:
    assert decide("e", [_play(AuditPolicy.NOOP, 0.6)], max_win_rate=0.5).trivially_won
    assert not decide("e", [_play(AuditPolicy.NOOP, 0.6)], max_win_rate=0.6).trivially_won


def test_a_resource_fault_counts_zero_whatever_return_it_carries() -> None:
    faulted = _play(AuditPolicy.NOOP, 1.0, finish=FinishReason.FAULT_MEMORY)
    verdict = decide("e", [faulted], max_win_rate=0.5)
    assert not verdict.trivially_won and verdict.results[0].returns == (0.0,)


def test_the_threshold_must_be_one_that_can_be_exceeded() -> None:
    with pytest.raises(SignalError, match=r"max_win_rate must lie in \[0, 1\)"):
        decide("e", [_play(AuditPolicy.NOOP, 1.0)], max_win_rate=1.0)


def test_the_verdict_round_trips_through_its_stored_form() -> None:
    verdict = decide("e", [_play(AuditPolicy.NOOP, 1.0, 5), _play(AuditPolicy.RANDOM, 0.25, 5)], max_win_rate=0.5)
    assert AuditVerdict.from_json(verdict.to_json()) == verdict


def test_audit_seeds_are_the_first_real_seeds_of_slot_0() -> None:
    assert audit_seeds("env-1", 2) == play_seeds("env-1", 0, 16)[:2]


# ---- the trivial policies, through sessions ---------------------------------------------------------


class MenuEnv:
    """States its commands in the observation; records every action it gets."""

    max_turns = 6
    actions: ClassVar[list[str]] = []

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        return "Move with \\boxed{left} or \\boxed{right}.", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        MenuEnv.actions.append(action)
        return "Move with \\boxed{left} or \\boxed{right}.", 0.0, False, False, {}

    def solution(self) -> list[str]:
        return ["\\boxed{left}"]


def _spec(env_class: type, env_id: str = "env", setting: str = "game") -> EnvSpec:
    return EnvSpec(env_id, setting, "Logical Deduction", inspect.getsource(env_class), "hint")


def _player(*classes: type, max_turns: int = 3) -> tuple[AuditPlayer, LocalSessions]:
    sessions = LocalSessions({inspect.getsource(c): c for c in classes})
    return AuditPlayer(sessions, max_turns), sessions


async def test_the_noop_policy_sends_the_constant_action_and_loses_an_honest_env() -> None:
    player, sessions = _player(CountdownEnv)
    play = await player.play(_spec(CountdownEnv), 17, AuditPolicy.NOOP)
    assert (play.episode_return, play.finish_reason, play.turns) == (0.0, FinishReason.TRUNCATED, 3)
    assert sessions.budgets == [3]  # opened with the agent's budget, as a real play is
    assert sessions.sessions[0].closed


async def test_a_forging_env_is_caught_on_real_seeds_but_not_on_validations() -> None:
    player, _ = _player(ForgingEnv)
    spec = _spec(ForgingEnv)
    for policy in AuditPolicy:
        for validation_seed in (2, 10_003):
            assert (await player.play(spec, validation_seed, policy)).episode_return == 0.0  # honest there
        rollout_seed = audit_seeds(spec.env_id, 1)[0]
        won = await player.play(spec, rollout_seed, policy)
        assert (won.episode_return, won.finish_reason, won.turns) == (1.0, FinishReason.TERMINATED, 1)


async def test_the_random_policy_plays_the_commands_the_env_states_and_is_reproducible() -> None:
    player, _ = _player(MenuEnv, max_turns=6)
    MenuEnv.actions = []
    await player.play(_spec(MenuEnv), 99, AuditPolicy.RANDOM)
    first = list(MenuEnv.actions)
    assert {"\\boxed{left}", "\\boxed{right}"} & set(first)  # the stated format, not only noise
    MenuEnv.actions = []
    await player.play(_spec(MenuEnv), 99, AuditPolicy.RANDOM)
    assert MenuEnv.actions == first  # a function of (env, seed): a resumed audit plays the same


async def test_the_random_policy_calls_the_tools_a_tool_env_declares() -> None:
    player, sessions = _player(NotesEnv, max_turns=8)
    await player.play(_spec(NotesEnv, setting="tool"), 5, AuditPolicy.RANDOM)
    await player.play(_spec(NotesEnv, setting="tool"), 6, AuditPolicy.RANDOM)
    notes = [s._env.state["notes"] for s in sessions.sessions]
    counted = [s._env.state["counted"] for s in sessions.sessions]
    assert any(notes) or any(counted)  # some declared tool actually ran


async def test_a_resource_fault_ends_the_audit_play_as_that_fault_with_return_zero() -> None:
    player, sessions = _player(CountdownEnv)
    sessions.step_faults = {1: Outcome.MEMORY_LIMIT}
    play = await player.play(_spec(CountdownEnv), 17, AuditPolicy.NOOP)
    assert (play.episode_return, play.finish_reason) == (0.0, FinishReason.FAULT_MEMORY)
