"""The gymnasium adapter over example envs, checked by gymnasium's own env checker."""

from __future__ import annotations

import warnings

import pytest
from gymnasium.utils.env_checker import check_env

from spade.envs.examples import EXAMPLES
from spade.envs.gym_adapter import GymnasiumEnv
from spade.envs.session import EnvSession


@pytest.mark.parametrize("name", ["code_breaker", "order_desk"])
def test_passes_gymnasium_check_env(name: str) -> None:
    example = EXAMPLES[name]
    env = GymnasiumEnv.from_code(example.code, example.setting, seed=0, render_mode="ansi")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any checker warning is a failure here
        check_env(env, skip_render_check=True)


def test_plays_an_episode_to_a_win() -> None:
    example = EXAMPLES["fog_maze"]
    env = GymnasiumEnv.from_code(example.code, example.setting, render_mode="ansi")
    observation, info = env.reset(seed=3)
    assert env.observation_space.contains(observation)
    assert info["spade"] == {"outcome": "ok", "turn": 0, "max_turns": 25}
    reward, terminated = 0.0, False
    assert isinstance(env.session, EnvSession)
    for action in env.session.env.solution():
        observation, reward, terminated, truncated, info = env.step(action)
        assert not truncated
    assert terminated and reward == 1.0 and env.render() == observation


def test_reset_without_seed_visits_different_instances() -> None:
    example = EXAMPLES["code_breaker"]
    env = GymnasiumEnv.from_code(example.code, example.setting)
    env.reset(seed=1)
    codes = set()
    for _ in range(5):
        env.reset()
        assert isinstance(env.session, EnvSession)
        codes.add(tuple(env.session.env.code))
    assert len(codes) > 1


def test_wraps_any_session_like_object() -> None:
    class Outcome:
        def __init__(self, text: str, done: bool) -> None:
            self.observation, self.reward, self.terminated, self.truncated = text, 1.0, done, False
            self.info: dict[str, object] = {}

    class RemoteSession:
        def reset(self, seed: int | None = None) -> Outcome:
            return Outcome(f"instance {seed}", False)

        def step(self, action: str) -> Outcome:
            return Outcome(action.upper(), True)

    env = GymnasiumEnv(RemoteSession())
    assert env.reset(seed=7) == ("instance 7", {})
    assert env.step("go") == ("GO", 1.0, True, False, {})
    with pytest.raises(ValueError, match="render_mode"):
        GymnasiumEnv(RemoteSession(), render_mode="human")
