"""What one learner step did: ``StepReport``, and its figures under one flat namespace for logs and dashboards."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from services.learner.core.window import ScoredAttempt
from services.learner.publisher import PublishResult
from services.learner.trainer import StepMetrics


@dataclass
class StepReport:
    """What one ``run_step`` did.

    Attributes:
        version: The learner's weight version after the step.
        trained: Whether an optimiser step happened (False when nothing trainable was ready).
        metrics: The trainer's metrics (``None`` when not trained).
        counters: Counts of this step (samples, groups kept/dropped, stale, duplicates, refusals,
            resource faults per reason, designer attempts by outcome and unscored reason, ...).
        designer_rewards: The designer attempts scored in this step.
        publish: The weight publication, when this step published.
        checkpoint: The checkpoint written by this step, if any.
        staleness: Versions behind the learner of the trained samples' weights, per role (mean, max).
        advantages: ``designer/advantage_nonzero_frac``, ``designer/advantage_abs_mean`` and
            ``agent/advantage_abs_mean`` (before per-role scaling), when the step had any.
        stopped: The step was abandoned because the learner was told to stop.
        timings: Seconds of the step's parts, one after another: ``wait`` (for enough samples),
            ``assemble`` (the batch and the designer rewards), ``train`` (the optimiser step),
            ``weights`` (writing the version to publish), ``checkpoint``, ``publish`` (until the
            inference servers acknowledged the new weights, reload included). In the step's log line
            and ``flat_metrics`` as ``time/<part>_s``.
    """

    version: int
    trained: bool
    metrics: StepMetrics | None
    counters: dict[str, int]
    designer_rewards: list[ScoredAttempt] = field(default_factory=list)
    publish: PublishResult | None = None
    checkpoint: Path | None = None
    staleness: dict[str, float] = field(default_factory=dict)
    advantages: dict[str, float] = field(default_factory=dict)
    stopped: bool = False
    timings: dict[str, float] = field(default_factory=dict)

    def flat_metrics(self) -> dict[str, float]:
        """Every figure of the step under one flat namespace (for logs and dashboards)."""
        out: dict[str, float] = {"version": float(self.version)}
        if self.metrics is not None:
            out.update(self.metrics.as_dict())
        out.update({f"count/{k}": float(v) for k, v in self.counters.items()})
        out.update(self.staleness)
        out.update(self.advantages)
        out.update({f"time/{part}_s": round(seconds, 4) for part, seconds in self.timings.items()})
        scored = [s.components for s in self.designer_rewards if s.components is not None]
        for name in ("regret", "regret_norm", "window_win_rate", "plateau", "blend"):
            values = [getattr(c, name) for c in scored if getattr(c, name) is not None]
            if values:
                out[f"designer/{name}_mean"] = sum(values) / len(values)
        return out
