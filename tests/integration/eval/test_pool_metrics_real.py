"""Process metrics with the real parts: the packaged MiniLM for Vendi, the real sandbox for probes."""

from __future__ import annotations

import os
import textwrap

import pytest

from services.sandbox.isolation import SandboxPool
from spade import pool_metrics as pm
from spade.envs.examples import EXAMPLES

LEAKY_ENV = textwrap.dedent(
    """
    import random

    class SecretEnv:
        max_turns = 3

        def reset(self, seed=None):
            self.rng = random.Random(seed)
            self.secret = self.rng.randint(100, 999)
            self.tries = 0
            return f"Guess my number. (Between us: the secret number is {self.secret}.)", {}

        def step(self, action):
            won = action.strip() == "\\\\boxed{%d}" % self.secret
            return ("yes" if won else "no"), (1.0 if won else 0.0), True, False, {}

        def solution(self):
            return ["\\\\boxed{%d}" % self.secret]
    """
)


async def test_the_probe_measures_hidden_state_and_solution_in_the_sandbox(sandbox: SandboxPool) -> None:
    number_hunt = EXAMPLES["number_hunt"]
    probe = await pm.probe_env(sandbox, number_hunt.code, "game", seed=5)
    assert probe.error == "" and "target" in probe.hidden_attributes
    assert "rng" not in probe.hidden_attributes and probe.hidden_state_bytes > 0
    assert probe.first_observation.startswith("I picked a whole number")
    assert not pm.leaks_answer(probe.first_observation, probe.solution).leaked
    tool = await pm.probe_env(sandbox, EXAMPLES["order_desk"].code, "tool", seed=5)
    assert tool.error == "" and "state" in tool.hidden_attributes and tool.solution == ()


async def test_a_leaky_env_is_caught_from_its_own_reset_and_solution(sandbox: SandboxPool) -> None:
    probe = await pm.probe_env(sandbox, LEAKY_ENV, "game", seed=3)
    assert probe.error == "" and set(probe.hidden_attributes) == {"secret", "tries"}
    verdict = pm.leaks_answer(probe.first_observation, probe.solution)
    assert verdict.leaked and verdict.rule == "answer-cue"


async def test_env_code_runs_only_in_the_jail(sandbox: SandboxPool) -> None:
    marker = f"/tmp/spade-eval-probe-{id(sandbox)}"
    hostile = LEAKY_ENV.replace("self.tries = 0", f"self.tries = 0; open({marker!r}, 'w').write('x')")
    probe = await pm.probe_env(sandbox, hostile, "game", seed=1)
    assert probe.error == ""  # it ran, in its jail's private /tmp ...
    assert not os.path.exists(marker)  # ... and nothing reached this machine's /tmp
    broken = await pm.probe_env(sandbox, "class BrokenEnv:\n    def reset(self, seed=None):\n        1/0\n", "game")
    assert "ZeroDivisionError" in broken.error or "missing" in broken.error


@pytest.mark.slow
async def test_vendi_over_minilm_embeddings(sandbox: SandboxPool) -> None:
    embedder = pm.MiniLMEmbedder()
    descriptions = []
    for example in EXAMPLES.values():
        setting = str(getattr(example.setting, "value", example.setting))
        probe = await pm.probe_env(sandbox, example.code, setting, seed=0)
        descriptions.append(pm.env_description(example.code, probe.first_observation))
    n = len(descriptions)
    assert pm.vendi_per_n([descriptions[0]] * n, embedder) == pytest.approx(1.0 / n, rel=1e-4)
    distinct = pm.vendi_per_n(descriptions, embedder)
    assert distinct is not None and distinct > 0.5  # seven different envs: near n effective envs
    near_copies = [descriptions[0] + f"\n# variant {i}" for i in range(n)]
    copies = pm.vendi_per_n(near_copies, embedder)
    assert copies is not None and 1.0 / n <= copies < distinct
