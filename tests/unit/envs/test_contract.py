"""The game contract: the optional GameEnv base, the Protocol and the shape checks."""

from __future__ import annotations

import pytest

from spade.envs.checker import check_env_source
from spade.envs.contract import ContractError, GameEnvContract, as_flag, unpack_reset, unpack_step
from spade.envs.examples import EXAMPLES
from spade.envs.loader import load_env_class
from tests.unit.envs.sample_envs import GUESS_GAME, mutate


def test_an_env_built_on_the_gameenv_base_validates() -> None:
    code = mutate(GUESS_GAME, "class GuessEnv:", "class GuessEnv(GameEnv):")
    code = mutate(code, "    def __init__(self):\n", "    def __init__(self):\n        super().__init__()\n")
    code = mutate(code, "self.rng = random.Random(seed)\n", "self.begin(seed)\n")
    code = mutate(code, "self.turn += 1\n", "self.tick()\n")
    report = check_env_source(code, "game")
    assert report.valid, report.summary()


@pytest.mark.parametrize("name", ["code_breaker", "counterfeit_coin", "fog_maze"])
def test_game_examples_satisfy_the_protocol(name: str) -> None:
    loaded = load_env_class(EXAMPLES[name].code, "game")
    assert loaded.env_class is not None
    assert isinstance(loaded.env_class(), GameEnvContract)


def test_shape_checks_name_the_expected_shape() -> None:
    assert unpack_reset("bare observation") == ("bare observation", {})
    assert unpack_step(("o", 1, True, 0, None)) == ("o", 1.0, True, False, {})
    with pytest.raises(ContractError, match=r"reset\(\) must return \(observation: str, info: dict\)"):
        unpack_reset(("o", {}, 3))
    with pytest.raises(ContractError, match="observation must be a str, got int"):
        unpack_step((1, 0.0, False, False, {}))
    with pytest.raises(ContractError, match="reward must be a number, got bool"):
        unpack_step(("o", True, False, False, {}))
    with pytest.raises(ContractError, match="terminated must be a bool, got str"):
        as_flag("yes", "terminated")
    with pytest.raises(ContractError, match="info must be a dict, got list"):
        unpack_step(("o", 0.0, False, False, []))
