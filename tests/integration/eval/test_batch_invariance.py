"""An eval slice with the real SmolLM2 gives the same replies at any concurrency (``batch_invariant``),
in two runs of the same eval (every turn's sampling seeded).

The replies are compared as text; that the numbers behind them would move without the mode is shown
with logprob bits in tests/integration/inference/test_batch_invariance.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from services.eval.settings import EvalSettings
from services.eval.store import read_run
from services.eval.wiring import EvalRequest, ServedModel, run_eval
from services.inference.wiring import ServerHandle
from services.rollout.sandbox import PoolSessions
from services.sandbox.isolation import SandboxPool
from spade.inference.client import InferenceClient
from tests.integration.eval.conftest import game_examples_export

pytestmark = [pytest.mark.slow, pytest.mark.model, pytest.mark.timeout(1800)]


async def test_a_slice_gives_the_same_replies_one_at_a_time_and_four_at_once(
    server: ServerHandle, client: InferenceClient, tmp_path: Path
) -> None:
    served = ServedModel(client, "smollm2", "0", str(server.engine.model_path))
    replies = {}
    for concurrency in (1, 4):
        settings = EvalSettings(
            concurrency=concurrency,
            max_new_tokens=32,
            bootstrap_resamples=200,
            reasoning_gym={"items_per_category": 1},
        )
        out = tmp_path / f"concurrency-{concurrency}"
        asked = server.engine.work.invariant_prefills
        await run_eval(EvalRequest("reasoning-gym", None, 0, 4, out), settings, model=served)
        assert server.engine.work.invariant_prefills - asked == 4  # every request asked for the mode
        header, items = read_run(out)
        assert header.sampling["batch_invariant"] == "per-request"
        replies[concurrency] = {item.id: item.response for item in items}
    assert len(replies[1]) == 4
    assert replies[4] == replies[1]


@pytest.mark.sandbox
async def test_the_pool_suite_gives_the_same_replies_in_two_runs_at_different_concurrency(
    server: ServerHandle, client: InferenceClient, sandbox: SandboxPool, tmp_path: Path
) -> None:
    # The held-out evaluation of `spade run` is this suite: unseeded turns made its "before" figure
    # differ from run to run on the same weights (issue 19).
    export = game_examples_export(tmp_path / "envs.jsonl")
    served = ServedModel(client, "smollm2", "0", str(server.engine.model_path))
    replies = {}
    for concurrency in (1, 4):
        settings = EvalSettings(
            concurrency=concurrency,
            temperature=1.0,
            bootstrap_resamples=200,
            pool={
                "source": str(export),
                "setting": "game",
                "seeds_per_env": 2,
                "max_turns": 2,
                "max_tokens_per_turn": 24,
                "max_total_tokens": 2048,
            },
        )
        out = tmp_path / f"concurrency-{concurrency}"
        await run_eval(EvalRequest("pool", None, 0, None, out), settings, model=served, sessions=PoolSessions(sandbox))
        header, items = read_run(out)
        assert header.sampling["batch_invariant"] == "per-request"
        replies[concurrency] = {item.id: item.response for item in items}
    assert len(replies[1]) == 4 and all(replies[1].values())
    assert replies[4] == replies[1]
