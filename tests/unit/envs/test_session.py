"""EnvSession: turn limits, explicit outcomes, time limits, caps; and the loader's class picking."""

from __future__ import annotations

import json

import pytest

from spade.envs.examples import EXAMPLES
from spade.envs.loader import load_env_class
from spade.envs.session import EnvLoadError, EnvSession, SessionError
from spade.envs.types import CheckConfig, Outcome, StepOutcome
from tests.unit.envs.sample_envs import GUESS_GAME, NOTES_TOOL, mutate

ECHO = r"""
class EchoEnv:
    max_turns = 50

    def reset(self, seed=None):
        self.seed = seed
        return f"seed {seed}", {"seed": seed, "obj": object()}

    def step(self, action):
        if "crash" in action:
            return {}["missing"]
        if "spin" in action:
            while True:
                pass
        if "swallow" in action:
            try:
                while True:
                    pass
            except BaseException:
                return "escaped the alarm", 0.0, False, False, {}
        if "big" in action:
            return "x" * 50_000, 0.0, False, False, {}
        if "bad" in action:
            return "four", 0.0, False
        if "nan" in action:
            return "n", float("nan"), False, False, {}
        if "print" in action:
            print("LEAKED TO STDOUT")
        if "win" in action:
            return "won", 3.0, True, False, {}
        if "partial" in action:
            return "half", -0.5, False, False, {}
        return action, 0.0, False, False, {}

    def solution(self):
        return ["\\boxed{win}"]
"""


def session(code: str = ECHO, seed: int = 1, **config) -> EnvSession:
    return EnvSession(code, "game", seed, CheckConfig(**config))


def test_reset_gives_turn_zero_and_json_safe_info() -> None:
    first = session().reset()
    assert (first.observation, first.turn, first.max_turns, first.outcome) == ("seed 1", 0, 25, Outcome.OK)
    json.dumps(first.to_dict())
    assert first.info["seed"] == 1 and isinstance(first.info["obj"], str)


def test_game_actions_are_normalised() -> None:
    s = session()
    s.reset()
    assert s.step("Let me think... \\boxed{ left }").observation == "\\boxed{left}"
    assert s.step("  no box  ").observation == "no box"


def test_max_turns_is_capped_and_truncates_with_limit_outcome() -> None:
    s = session(max_turns_cap=3)
    s.reset()
    outcomes = [s.step("\\boxed{go}") for _ in range(3)]
    assert [o.truncated for o in outcomes] == [False, False, True]
    assert outcomes[-1].outcome is Outcome.LIMIT and outcomes[-1].max_turns == 3
    assert s.done and s.episode_return == 0.0
    with pytest.raises(SessionError, match=r"already ended \(truncated at turn 3\); call reset"):
        s.step("\\boxed{go}")


def test_terminal_reward_is_the_return_and_rewards_are_clamped() -> None:
    s = session()
    s.reset()
    assert s.step("\\boxed{partial}").reward == 0.0
    last = s.step("\\boxed{win}")
    assert (last.reward, last.terminated, last.outcome) == (1.0, True, Outcome.OK)
    assert s.episode_return == 1.0 == last.episode_return


def test_env_exception_is_env_error_with_a_short_message() -> None:
    s = session()
    s.reset()
    out = s.step("\\boxed{crash}")
    assert out.outcome is Outcome.ENV_ERROR and out.truncated and out.reward == 0.0
    assert out.observation.startswith("Environment error in step(): KeyError: 'missing' (env code line ")
    assert "Traceback" not in out.observation and "spade/envs" not in out.observation
    with pytest.raises(SessionError):
        s.step("\\boxed{again}")


@pytest.mark.parametrize(("action", "fragment"), [("bad", "must return (observation"), ("nan", "must be finite")])
def test_contract_violations_are_env_errors(action: str, fragment: str) -> None:
    s = session()
    s.reset()
    out = s.step(f"\\boxed{{{action}}}")
    assert out.outcome is Outcome.ENV_ERROR and fragment in out.observation


@pytest.mark.parametrize("action", ["spin", "swallow"])
def test_calls_over_the_time_limit_time_out(action: str) -> None:
    s = session(call_time_limit_s=0.2)
    s.reset()
    out = s.step(f"\\boxed{{{action}}}")
    assert out.outcome is Outcome.TIMEOUT and out.truncated
    assert "took longer than 0.2 s" in out.observation


def test_observation_is_cut_to_the_cap() -> None:
    s = session(observation_cap=1000)
    s.reset()
    out = s.step("\\boxed{big}")
    assert len(out.observation) <= 1000 and "observation cut" in out.observation


def test_env_prints_do_not_reach_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    s = session()
    s.reset()
    s.step("\\boxed{print}")
    assert "LEAKED" not in capsys.readouterr().out


def test_step_before_reset_and_bad_action_type() -> None:
    s = session()
    with pytest.raises(SessionError, match="before reset"):
        s.step("x")
    s.reset()
    with pytest.raises(TypeError, match="action must be a str"):
        s.step(3)  # type: ignore[arg-type]


def test_reset_builds_a_fresh_instance_and_accepts_a_new_seed() -> None:
    s = EnvSession(GUESS_GAME, "game", seed=4)
    s.reset()
    first = s.env
    assert s.reset(seed=9).turn == 0 and s.env is not first and s.seed == 9


def test_numpy_bool_flags_are_accepted() -> None:
    pytest.importorskip("numpy")
    code = mutate(
        GUESS_GAME,
        'return "Correct!", 1.0, True, False, {}',
        'return "Correct!", np.float64(1.0), np.bool_(True), np.bool_(False), {}',
    )
    code = "import numpy as np\n" + code
    s = EnvSession(code, "game", seed=2)
    s.reset()
    out = None
    for action in s.env.solution():
        out = s.step(action)
    assert out is not None and out.terminated is True and out.reward == 1.0 and out.outcome is Outcome.OK


def test_reset_failure_is_an_env_error_outcome() -> None:
    code = mutate(GUESS_GAME, "self.secret = self.rng.randint(1, 1000)", "self.secret = 1 / 0")
    out = EnvSession(code, "game", seed=0).reset()
    assert out.outcome is Outcome.ENV_ERROR and "ZeroDivisionError" in out.observation


def test_tool_session_plays_the_example_solution() -> None:
    example = EXAMPLES["order_desk"]
    s = EnvSession(example.code, "tool", seed=5)
    first = s.reset()
    assert first.info["tools"] and first.observation == first.info["instruction"]
    out = None
    for block in s.env.solution_calls():
        for c in block:
            out = s.step(c.to_text())
    assert out is not None and out.terminated and s.episode_return == 1.0


def test_step_outcome_round_trip() -> None:
    out = StepOutcome("o", 0.5, False, True, {"a": [1]}, 3, 10, Outcome.LIMIT)
    assert StepOutcome.from_dict(json.loads(json.dumps(out.to_dict()))) == out


@pytest.mark.parametrize(
    ("code", "fragment"),
    [
        ("x = 1\n", "no class whose name ends in 'Env'"),
        (GUESS_GAME + "\nclass OtherEnv(GuessEnv.__mro__[1]):\n    pass\n", "several env classes"),
        (mutate(GUESS_GAME, "def solution(self):", "def answer(self):"), "missing solution()"),
        ("import numpy_does_not_exist\n", "ModuleNotFoundError"),
        ("raise ValueError('boom')\n", "running the module raised ValueError: boom (env code line 1)"),
    ],
)
def test_load_errors_explain_themselves(code: str, fragment: str) -> None:
    with pytest.raises(EnvLoadError) as raised:
        EnvSession(code, "game", seed=0)
    assert fragment in str(raised.value)
    assert any(fragment in p for p in load_env_class(code, "game").problems)


def test_loader_skips_helper_base_classes_and_imported_bases() -> None:
    code = "from spade.envs import ToolEnv, GameEnv\n" + GUESS_GAME.replace(
        "class GuessEnv:", "class BaseEnv:\n    pass\n\n\nclass GuessEnv(BaseEnv):"
    )
    loaded = load_env_class(code, "game")
    assert loaded.ok and loaded.env_class is not None and loaded.env_class.__name__ == "GuessEnv"


def test_tool_env_class_is_preinjected_and_setting_is_enforced() -> None:
    code = NOTES_TOOL.replace("from spade.envs import ToolEnv\n", "")
    assert load_env_class(code, "tool").ok
    assert any("setting is 'game'" in p for p in load_env_class(NOTES_TOOL, "game").problems)
    assert any("must subclass ToolEnv" in p for p in load_env_class(GUESS_GAME, "tool").problems)
    overriding = mutate(
        NOTES_TOOL,
        "    def setup(self, rng):",
        "    def step(self, action):\n        return ''\n\n    def setup(self, rng):",
    )
    assert any("overrides step()" in p for p in load_env_class(overriding, "tool").problems)
    with pytest.raises(ValueError, match="setting must be 'game' or 'tool'"):
        load_env_class(GUESS_GAME, "puzzle")


def test_tool_outputs_in_info_are_cut_like_observations() -> None:
    code = mutate(NOTES_TOOL, 'return "12:00"', 'return "t" * 20_000')
    s = EnvSession(code, "tool", seed=0, config=CheckConfig(observation_cap=500))
    s.reset()
    out = s.step('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    assert len(out.observation) <= 500
    output = out.info["tool_results"][0]["output"]
    assert len(output) <= 500 and "observation cut" in output
