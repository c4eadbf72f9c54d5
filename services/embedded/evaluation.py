"""In-run evaluation: ``spade run --eval-every N --eval-suite NAME [--eval-limit M]``.

Before the first step and every ``N`` steps the current weights are scored through ``services/eval``
(the same suites, scorers and result files as ``spade eval``), in this process, against the run's own
inference server and sandbox pool. The slice is fixed for the whole run — the first ``M`` items of the
suite at ``eval_seed``, and for the ``pool`` suite the pool as it was before the first step (written
to ``eval/pool.jsonl``) — so the points of the curve are comparable. Each eval writes
``eval/step-NNNN/`` (``items.jsonl``, ``summary.json``) and its figures go to that step's line of
``metrics.jsonl``: ``eval/<suite>/overall`` with ``_low``/``_high`` (the bootstrap interval) and
``_n``, and ``eval/<suite>/<category>`` per category.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spade.serving.logs import get_logger

if TYPE_CHECKING:
    from services.embedded.settings import RunSettings
    from services.embedded.system import EmbeddedParts
    from services.eval.core.records import Summary

log = get_logger(__name__)


def summary_metrics(suite: str, summary: Summary) -> dict[str, Any]:
    """The figures of one eval for ``metrics.jsonl``."""
    from services.eval.core.records import OVERALL

    out: dict[str, Any] = {}
    for name, interval in summary.categories.items():
        key = f"eval/{suite}/{name}"
        out[key] = interval.mean
        if name == OVERALL:
            out[f"{key}_low"] = interval.low
            out[f"{key}_high"] = interval.high
            out[f"{key}_n"] = interval.n
    out[f"eval/{suite}/errors"] = summary.errors
    return out


class InRunEval:
    """Scores the current weights on the run's fixed slice (see the module docstring).

    Args:
        settings: The run's settings (``eval_every``, ``eval_suite``, ``eval_limit``, ``eval_seed`` and
            the agent's budget, which the ``pool`` suite plays under).
        parts: The run's inference server, client and sandbox pool.
    """

    def __init__(self, settings: RunSettings, parts: EmbeddedParts) -> None:
        self.settings = settings
        self.parts = parts
        self.directory = settings.run_dir / "eval"
        self.pool_file = self.directory / "pool.jsonl"

    def due(self, step: int) -> bool:
        """Whether the eval runs after ``step`` (0: before the first step; the last with ``held_out_eval``)."""
        every = self.settings.eval_every
        ends = self.settings.held_out_eval and step in (0, self.settings.steps)
        return ends or (every > 0 and step % every == 0)

    def eval_settings(self) -> Any:
        from services.eval.settings import EvalSettings

        s = self.settings
        return EvalSettings(
            dev_mode=True,
            temperature=s.temperature,
            # Every item at once: the batch-invariant rows share decode passes (docs/inference.md), and
            # the figures are the same at any concurrency (a default run's evals: 7 and 12 s at 4 → 4 and 5 s).
            concurrency=16,
            pool={
                "source": str(self.pool_file),
                "setting": s.setting,
                "seeds_per_env": 2,
                "max_turns": s.agent_max_turns,
                "max_tokens_per_turn": s.agent_max_tokens_per_turn,
                "max_total_tokens": s.agent_max_total_tokens,
            },
        )

    async def snapshot_pool(self) -> int:
        """Fix the ``pool`` suite's envs before the first step; returns how many are playable.

        The held-out environment families of the run's setting (``spade.envs.families``: never in the
        seed pool, the warm start or any other training use) at ``eval_difficulties`` each, when the
        setting has any, so the eval measures transfer to envs the run never trained on; else the
        pool as it is now.
        """
        from services.embedded.system import export_pool
        from spade.envs.families import held_out_families, spread

        self.directory.mkdir(parents=True, exist_ok=True)
        held_out = held_out_families(self.settings.setting)
        if not held_out:
            rows = await export_pool(self.parts.memory, self.pool_file)
            return sum(1 for row in rows if row["status"] in ("valid", "retired"))
        envs = [f.generate(d) for f in held_out for d in spread(self.settings.eval_difficulties)]
        with self.pool_file.open("w") as fh:
            for env in envs:
                row = {
                    "env_id": env.name,
                    "setting": env.setting,
                    "skill": env.skill,
                    "status": "valid",
                    "corpus_ref": f"held-out family: {env.family}",
                    "code": env.code,
                    "hint": env.hint,
                }
                fh.write(json.dumps(row) + "\n")
        return len(envs)

    async def __call__(self, step: int, weight_version: int) -> dict[str, Any]:
        """Evaluate the weights now served; returns the figures (empty, with a log line, when it cannot run)."""
        from services.eval.wiring import EvalRequest, EvalSetupError, ServedModel, run_eval
        from services.rollout.sandbox import PoolSessions

        suite = self.settings.eval_suite
        request = EvalRequest(
            suite=suite,
            model=self.parts.server.url,
            seed=self.settings.eval_seed,
            limit=self.settings.eval_limit,
            out=eval_dir(self.settings.run_dir, step),
            tokenizer=self.parts.model,
        )
        model = ServedModel(
            client=self.parts.client,
            label=f"spade run {self.settings.run_dir.name}",
            weight_version=str(weight_version),
            served_model=str(self.parts.model),
        )
        sessions = PoolSessions(self.parts.pool, self.parts.checks)
        try:
            outcome = await run_eval(request, self.eval_settings(), model=model, sessions=sessions)
        except EvalSetupError as exc:
            log.warning("in-run eval at step %d skipped: %s", step, exc)
            return {f"eval/{suite}/skipped": str(exc)}
        figures = summary_metrics(suite, outcome.summary)
        log.info("in-run eval at step %d (v%d): %s", step, weight_version, figures.get(f"eval/{suite}/overall"))
        return figures


def eval_dir(run_dir: Path, step: int) -> Path:
    """Where the in-run eval after ``step`` writes its results."""
    return run_dir / "eval" / f"step-{step:04d}"


def held_out_difference(run_dir: Path, steps: int) -> dict[str, float] | None:
    """The held-out eval after the last step minus before the first, paired item by item.

    Returns ``mean``, ``low`` and ``high`` (the paired bootstrap interval), ``n`` (paired items),
    ``before`` and ``after`` (the mean scores over those items); None when either eval is missing.
    """
    from services.eval.core.compare import CompareError, compare
    from services.eval.core.records import OVERALL
    from services.eval.store import StoreError, read_run

    try:
        result = compare(read_run(eval_dir(run_dir, 0)), read_run(eval_dir(run_dir, steps)))
    except (StoreError, CompareError) as exc:
        log.warning("no held-out difference: %s", exc)
        return None
    interval = result.differences[OVERALL]
    before, after = result.means[OVERALL]
    return {
        "mean": interval.mean,
        "low": interval.low,
        "high": interval.high,
        "n": float(interval.n),
        "before": before,
        "after": after,
    }
