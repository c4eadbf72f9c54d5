"""The episode loop: prompts, actions, limits and outcomes, with the real tokenizer."""

from __future__ import annotations

import pytest

from services.rollout.policy import FormatterTemplate
from spade.agent.episode import EpisodeRunner, PlayLimits
from spade.agent.ports import EnvSpec
from spade.envs.types import FinishReason, Outcome
from spade.sandbox.errors import SandboxFault
from tests.unit.rollout.envs import BrokenEnv, CountdownEnv, EndlessEnv, NotesEnv, ShortEnv
from tests.unit.rollout.players import LocalSessions, ScriptedPolicy

GAME = EnvSpec("g1", "game", "Mathematical Reasoning", "countdown", hint="The number is in the text.")
TOOL = EnvSpec("t1", "tool", "API Orchestration", "notes", hint="Add, then count, then add done.")
SESSIONS = {"countdown": CountdownEnv, "broken": BrokenEnv, "notes": NotesEnv, "endless": EndlessEnv, "short": ShortEnv}


def _runner(
    template: FormatterTemplate, replies: list[str], **limits: int
) -> tuple[EpisodeRunner, ScriptedPolicy, LocalSessions]:
    policy = ScriptedPolicy(template, replies, weight_version=2)
    sessions = LocalSessions(dict(SESSIONS))
    return EpisodeRunner(sessions, policy, template, PlayLimits(**limits)), policy, sessions


def _user_text(template: FormatterTemplate, ids: list[int]) -> str:
    return template.decode(ids)


async def test_a_won_game_returns_the_terminal_reward(template: FormatterTemplate) -> None:
    target = CountdownEnv().reset(7)[0].split("it is ")[1].rstrip(").")
    runner, policy, sessions = _runner(template, ["hmm \\boxed{0}", f"so \\boxed{{{target}}} it is"])
    play = await runner.play(GAME, 7, hinted=False)
    assert (play.finish_reason, play.episode_return, play.turns) == (FinishReason.TERMINATED, 1.0, 2)
    assert sessions.opened == [("countdown", "game", 7)] and sessions.sessions[0].closed
    first_prompt = _user_text(template, policy.calls[0][0])
    assert "\\boxed{...}" in first_prompt and "Guess my number" in first_prompt
    assert "HINT" not in first_prompt
    # The second turn's input is the first turn's sequence plus the env's answer, nothing rewritten.
    second_input = policy.calls[1][0]
    assert "Wrong ('\\\\boxed{0}')" in _user_text(template, second_input)
    assert play.trajectory.token_ids[: len(second_input)] == second_input
    assert play.trajectory.weight_versions == [2, 2]


async def test_the_hint_is_appended_to_the_first_observation_only_in_hinted_plays(template: FormatterTemplate) -> None:
    runner, policy, _ = _runner(template, ["\\boxed{0}"])
    await runner.play(GAME, 1, hinted=True)
    prompt = _user_text(template, policy.calls[0][0])
    assert prompt.index("Guess my number") < prompt.index("HINT: The number is in the text.")
    assert _user_text(template, policy.calls[1][0]).count("HINT") == 1


async def test_the_env_truncating_returns_zero(template: FormatterTemplate) -> None:
    runner, _, _ = _runner(template, ["\\boxed{0}"])
    play = await runner.play(GAME, 3, hinted=False)
    assert (play.finish_reason, play.episode_return, play.turns) == (FinishReason.TRUNCATED, 0.0, 3)


async def test_turn_limit(template: FormatterTemplate) -> None:
    runner, policy, sessions = _runner(template, ["\\boxed{0}"], max_turns=2)
    play = await runner.play(GAME, 3, hinted=False)
    assert (play.finish_reason, play.turns, len(policy.calls)) == (FinishReason.TURN_LIMIT, 2, 2)
    assert sessions.budgets == [2]  # the sandbox session is opened with the agent's turn budget


async def test_an_env_declaring_more_turns_than_the_budget_is_clamped_and_the_play_says_so(
    template: FormatterTemplate,
) -> None:
    runner, policy, _ = _runner(template, ["\\boxed{0}"], max_turns=4)
    play = await runner.play(EnvSpec("e", "game", "s", "endless", ""), 1, hinted=False)
    # The env declares 400 turns; its session is capped at the agent's 4 and the play ends there
    # as the agent's budget (turn_limit), with the clamped cap on the play.
    assert (play.finish_reason, play.turns, play.turn_cap, len(policy.calls)) == (FinishReason.TURN_LIMIT, 4, 4, 4)


async def test_an_env_declaring_fewer_turns_than_the_budget_is_truncated_by_its_own_limit(
    template: FormatterTemplate,
) -> None:
    runner, _, _ = _runner(template, ["\\boxed{0}"], max_turns=8)
    play = await runner.play(EnvSpec("e", "game", "s", "short", ""), 1, hinted=False)
    assert (play.finish_reason, play.turns, play.turn_cap, play.episode_return) == (FinishReason.TRUNCATED, 2, 2, 0.0)


@pytest.mark.parametrize(
    ("outcome", "reason"),
    [
        (Outcome.MEMORY_LIMIT, FinishReason.FAULT_MEMORY),
        (Outcome.CPU_LIMIT, FinishReason.FAULT_CPU),
        (Outcome.OUTPUT_LIMIT, FinishReason.FAULT_OUTPUT),
        (Outcome.KILLED, FinishReason.FAULT_KILLED),
        (Outcome.TIMEOUT, FinishReason.FAULT_WALL_CLOCK),
        (Outcome.ENV_ERROR, FinishReason.ENV_ERROR),
    ],
)
async def test_a_resource_fault_ends_the_play_as_that_fault_never_as_truncated(
    template: FormatterTemplate, outcome: Outcome, reason: FinishReason
) -> None:
    runner, _, sessions = _runner(template, ["\\boxed{0}"])
    sessions.step_faults[2] = outcome  # the env blows a limit on its second step
    play = await runner.play(GAME, 3, hinted=False)
    assert (play.finish_reason, play.episode_return, play.turns) == (reason, 0.0, 2)


async def test_every_turn_carries_its_sampling_seed(template: FormatterTemplate) -> None:
    runner, policy, _ = _runner(template, ["\\boxed{0}"], max_turns=3)
    await runner.play(GAME, 3, hinted=False, turn_seeds=lambda turn: 1000 + turn)
    assert [s.seed for _, s in policy.calls] == [1000, 1001, 1002]
    unseeded, policy2, _ = _runner(template, ["\\boxed{0}"], max_turns=2)
    await unseeded.play(GAME, 3, hinted=False)
    assert [s.seed for _, s in policy2.calls] == [None, None]


async def test_total_and_per_turn_token_limits(template: FormatterTemplate) -> None:
    runner, policy, _ = _runner(template, ["word " * 50], max_tokens_per_turn=16, max_total_tokens=150)
    play = await runner.play(GAME, 3, hinted=False)
    assert play.finish_reason is FinishReason.TOKEN_LIMIT and play.episode_return == 0.0
    assert all(s.max_new_tokens <= 16 for _, s in policy.calls)
    assert len(play.trajectory) <= 150
    assert play.trajectory.model_tokens == 16 * play.turns


async def test_an_env_error_ends_the_play_with_zero(template: FormatterTemplate) -> None:
    runner, _, sessions = _runner(template, ["\\boxed{1}"])
    play = await runner.play(EnvSpec("b", "game", "s", "broken", ""), 1, hinted=False)
    assert (play.finish_reason, play.episode_return, play.turns) == (FinishReason.ENV_ERROR, 0.0, 1)
    assert sessions.sessions[0].closed


async def test_a_sandbox_fault_raises_for_a_retry_and_closes_the_session(template: FormatterTemplate) -> None:
    runner, _, sessions = _runner(template, ["\\boxed{1}"])
    sessions.fault_on.add(5)
    with pytest.raises(SandboxFault):
        await runner.play(GAME, 5, hinted=False)
    assert sessions.sessions[0].closed


def _call(name: str, **args: str) -> str:
    import json

    return "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"


async def test_a_tool_env_gets_its_tools_tool_messages_and_new_instructions_as_user_turns(
    template: FormatterTemplate,
) -> None:
    env = NotesEnv()
    env.reset(4)
    replies = [
        _call("add_note", text=env.word),
        _call("count"),
        "All set, nothing to call.",
        _call("add_note", text="done"),
    ]
    runner, policy, _ = _runner(template, replies)
    play = await runner.play(TOOL, 4, hinted=True)
    assert (play.finish_reason, play.episode_return, play.turns) == (FinishReason.TERMINATED, 1.0, 4)
    first = _user_text(template, policy.calls[0][0])
    assert '"add_note"' in first and f"Add a note saying {env.word}." in first and "HINT: Add, then count" in first
    second = _user_text(template, policy.calls[1][0])[len(first) :]
    assert "<tool_response>\nadded\n</tool_response>" in second and "Count the notes." in second
    fourth = _user_text(template, policy.calls[3][0])
    assert "No tool call found" in fourth  # a reply without a call gets the env's reminder as a user turn
