"""An eval slice with the real SmolLM2 gives the same replies at any concurrency (``batch_invariant``).

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
from spade.inference.client import InferenceClient

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
