"""The embedded main job's step loop: designer, rollout and learner, each step's learner beside the next step.

Every part runs in this process (``system.py``: the sandbox pool, a SQLite memory, the in-process
queue, the embedded inference server); each role gets the settings the run implies (``roles.py``);
the loop's time is measured where it hands work to the services (``instruments.py``).

One step of the loop, for weight version ``v``:

1. the designer writes a round of environments (validated in the sandbox, deduplicated and stored in
   the memory, announced on ``envs.ready``); every attempt becomes a designer sample;
2. the rollout plays each new env on G seeds without and with its hint (the same seeds), and the
   pool envs chosen for this step (``pool_choice.py``: expected signal first, retiring envs that
   carried none) on fresh seeds; a group without variance is extended with fresh seeds;
3. the learner turns the plays into agent advantages and the closed windows into designer rewards,
   takes one GRPO step, publishes version ``v+1`` to the inference server and announces it. A step
   that trains nothing says why in words (``metrics.why_not_trained``), and the next step's choice
   plays other envs.

With ``overlap_learner`` (the default) step 3 runs beside the next step's 1 and 2: once the learner
has taken the step's samples off the queues, the next step designs and plays on version ``v``, and
the learner's version ``v+1`` is published when that generation is done (:class:`PublishGate`), so
a step's plays and attempts always share one version, one behind the learner. On two cores the
learner's training and the server's generation still share the CPU well: the training is
compute-bound, small-batch decoding is bound by memory and Python.

With ``held_out_eval`` the weights are scored on held-out envs before the first step and after the
last, and the paired difference with its bootstrap interval heads the report.

Steps 1 and 2 stay one after the other on purpose. Playing the pool's envs beside the designer's round
(and each new env once announced) was built and measured on 2026-12-05: every step got slower (74, 47
and 92 s against 45, 68 and 87 s), because the inference server is already busy ~97% of a sequential
generation; plays beside the round only lengthen the round, and the new envs' plays still follow it.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.embedded.instruments import PhaseClock, TappedMemory, Timed
from services.embedded.pool_choice import PoolChoice
from services.embedded.roles import build_run_designer, check_context, role_settings, run_spec
from services.embedded.settings import RunSettings
from services.embedded.system import (
    EmbeddedParts,
    RunSetupError,
    embedded_system,
    export_pool,
    last_checkpoint,
    process_memory,
    release_after_step,
    release_freed_memory,
    seed_pool,
    served_weights,
    static_pool,
)
from spade.serving.logs import get_logger

if TYPE_CHECKING:
    from services.designer.core.loop import Designer
    from services.designer.core.pool import DesignerPool
    from services.designer.core.rounds import BatchResult
    from services.embedded.evaluation import InRunEval
    from services.learner.core.window import ScoredAttempt
    from services.learner.learner import Learner, StepReport
    from services.rollout.worker import RolloutWorker
    from spade.memory.records import Play
    from spade.runspec import RunSpec

__all__ = ["Progress", "RunResult", "RunSetupError", "StepListener", "run"]

log = get_logger(__name__)

_ENGINE_SECONDS = ("busy", "prefill", "decode")
"""The engine's ``<name>_s`` totals each step reports as ``time/inference_<name>_s``."""

_ENGINE_COUNTERS = (
    "generated_tokens",
    "prompt_tokens",
    "cached_tokens",
    "prefills",
    "prefill_passes",
    "decode_steps",
    "decode_rows",
)
"""The engine's work counters each step reports as ``work/inference_<name>`` (see ``EngineWork``)."""

Progress = Callable[[str, float, float], None]
"""``progress(phase, done, total)``: called as each phase advances (the CLI draws bars from it)."""

StepListener = Callable[[dict[str, Any]], None]
"""``on_step(record)``: called with each step's ``metrics.jsonl`` line as it is written."""


def _no_progress(phase: str, done: float, total: float) -> None:
    return None


@dataclass
class RunResult:
    """What a run left behind.

    Attributes:
        run_dir: The run directory.
        steps: Each step's ``metrics.jsonl`` line (step 0: the evaluation before the first step).
        report: ``report.html``.
        checkpoint: ``last_checkpoint/`` (None when no checkpoint was written).
        weight_version: The learner's version at the end.
        spec_id: The run spec's id.
        seeded: Env ids of the seed pool.
        static: Env ids of the static pool.
        departures: The run's departures from the paper.
        held_out: The paired difference of the held-out evaluation (after the last step minus before
            the first), when it ran: ``mean``, ``low``, ``high``, ``n``, ``before``, ``after``.
        audit_retired: (env id, why) of each env the rollout's audit plays retired as ``trivially_won``.
    """

    run_dir: Path
    steps: list[dict[str, Any]] = field(default_factory=list)
    report: Path | None = None
    checkpoint: Path | None = None
    weight_version: int = 0
    spec_id: str = ""
    seeded: list[str] = field(default_factory=list)
    static: list[str] = field(default_factory=list)
    departures: list[str] = field(default_factory=list)
    held_out: dict[str, float] | None = None
    audit_retired: list[tuple[str, str]] = field(default_factory=list)


def _reward_row(step: int, scored: ScoredAttempt) -> dict[str, Any]:
    """One line of ``designer_rewards.jsonl``: a designer sample as the learner scored it."""
    attempt, components = scored.attempt, scored.components
    row: dict[str, Any] = {
        "step": step,
        "sample_id": attempt.sample_id,
        "env_id": attempt.env_id,
        "skill": attempt.skill,
        "round": attempt.batch_id,
        "outcome": attempt.outcome,
        "trainable": attempt.trainable,
        "score": scored.outcome.value,
        "reason": scored.reason,
    }
    if components is not None:
        row.update(
            valid=components.valid,
            regret=components.regret,
            regret_norm=components.regret_norm,
            window_win_rate=components.window_win_rate,
            plateau=components.plateau,
            trivial_win_rate=components.trivial_win_rate,
            validity_fraction=components.validity_fraction,
            blend=components.blend,
        )
    return row


class PublishGate:
    """The learner's publisher, holding each publication until :attr:`open` is set.

    With the learner overlapped (``RunSettings.overlap_learner``), a step's training runs while the
    next step generates; its weights reach the server only when that generation is done, so every
    play and designer attempt of a step is generated under one weight version, whatever the timing.
    """

    def __init__(self, publisher: Any) -> None:
        self._publisher = publisher
        self.open = asyncio.Event()
        self.open.set()
        self.held_s = 0.0
        """Seconds publications were held since :meth:`take_held` (inside the learner's ``publish`` time)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self._publisher, name)

    async def publish(self, *args: Any, **kwargs: Any) -> Any:
        mark = time.perf_counter()
        await self.open.wait()
        self.held_s += time.perf_counter() - mark
        return await self._publisher.publish(*args, **kwargs)

    def take_held(self) -> float:
        held, self.held_s = self.held_s, 0.0
        return held


@dataclass
class Generated:
    """What one step's generation left for its ``metrics.jsonl`` line (see :meth:`StepLoop.generate`)."""

    step: int
    batch: BatchResult | None
    chosen: list[str]
    plays: list[Play]
    phases: dict[str, float]
    busy: dict[str, float]
    counts: dict[str, int]
    scored: list[ScoredAttempt] = field(default_factory=list)


@dataclass
class StepLoop:
    """The roles of one run and what a step needs between them (built by :func:`run`).

    A step is :meth:`generate` (the designer's round, then the plays), :meth:`start_training` (the
    learner takes the step's samples) and :meth:`finish` (the learner's step done and published, the
    step's line written). Sequentially they run one after another; overlapped, :func:`run` generates
    the next step while this one trains (see ``RunSettings.overlap_learner``).
    """

    settings: RunSettings
    spec: RunSpec
    parts: EmbeddedParts
    designer: Designer | DesignerPool | None
    learner: Learner
    worker: RolloutWorker
    tapped: TappedMemory
    clock: PhaseClock
    choice: PoolChoice
    scored: list[ScoredAttempt]
    gate: PublishGate | None
    progress: Progress
    start: float
    served_version: int = 0

    async def design(self, step: int) -> BatchResult | None:
        """A designer round, when one is due this step."""
        if self.designer is None or (step - 1) % self.settings.regenerate_every != 0:
            return None
        self.progress("designer", 0, 1)
        round_index = (step - 1) // self.settings.regenerate_every
        # The weights the server serves (one version behind the learner's while it trains, overlapped).
        batch = await self.designer.run_batch(round_index=round_index, weight_version=self.served_version)
        self.progress("designer", 1, 1)
        return batch

    async def play(self, step: int) -> list[str]:
        """Every due slot of a designed env, and of the pool envs chosen for this step; returns those."""
        self.progress("rollout", 0, 1)
        worker = self.worker
        await worker.step_weights()
        while await worker.step_envs():
            pass
        chosen = self.choice.choose(due=await worker.store.due_envs())
        await worker.play_due(skip=self.choice.skipped(chosen))
        returns: dict[str, list[float]] = defaultdict(list)
        for p in self.tapped.plays:
            if not p.hinted:
                returns[p.env_id].append(p.episode_return)
        self.choice.observe(step, returns)
        self.progress("rollout", 1, 1)
        return chosen

    async def generate(self, step: int) -> Generated:
        """The step's designer round and plays, on the weights the server serves now."""
        self.tapped.plays.clear()
        engine = self.parts.server.engine.work  # the server's own work (requests overlap)
        fields = [f"{part}_s" for part in _ENGINE_SECONDS] + list(_ENGINE_COUNTERS)
        engine_mark = {name: getattr(engine, name) for name in fields}
        phases: dict[str, float] = {}
        mark = time.perf_counter()
        batch = await self.design(step)
        phases["designer"] = time.perf_counter() - mark
        mark = time.perf_counter()
        chosen = await self.play(step)
        phases["rollout"] = time.perf_counter() - mark
        busy, counts = self.clock.take()
        for name, before in engine_mark.items():
            grew = getattr(engine, name) - before
            if name.endswith("_s"):
                phases[f"inference_{name.removesuffix('_s')}"] = grew
            else:
                counts[f"inference_{name}"] = grew
        return Generated(step, batch, chosen, list(self.tapped.plays), phases, busy, counts)

    async def start_training(self, generated: Generated, *, hold: bool) -> asyncio.Task[StepReport]:
        """Start the learner's step on ``generated``'s samples; return once it has taken them from the
        queues (or ended), so that nothing generated later joins its batch.

        Args:
            hold: Hold its publication until :meth:`finish` (another step generates meanwhile).

        Raises:
            Exception: The learner's step failed before it took its batch (raised here, not later).
        """
        self.progress("learner", 0, 1)
        if self.gate is not None and hold:
            self.gate.open.clear()  # before the step starts: it cannot publish before the next generation
        mark = time.perf_counter()
        assembled = asyncio.Event()
        training = asyncio.create_task(self.learner.run_step(on_assembled=assembled.set))
        waiting = asyncio.create_task(assembled.wait())
        try:
            await asyncio.wait({training, waiting}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            training.cancel()
            raise
        finally:
            waiting.cancel()
        if training.done() and training.exception() is not None:
            raise training.exception()  # type: ignore[misc]
        generated.phases["learner"] = time.perf_counter() - mark
        generated.scored = list(self.scored)  # the designer rewards the learner reported as it planned
        self.scored.clear()
        return training

    async def finish(
        self, generated: Generated, training: asyncio.Task[StepReport], evaluator: InRunEval | None
    ) -> dict[str, Any]:
        """Wait for the learner's step (publishing its weights now), then return the step's line.

        ``time/learner_s`` is the time the loop waited for the learner; overlapped, the part of its
        step that ran beside the next step's generation is ``time/learner_overlapped_s``.
        """
        from services.embedded.metrics import step_metrics, why_not_trained

        phases = generated.phases
        if self.gate is not None:
            self.gate.open.set()
        mark = time.perf_counter()
        report = await training
        phases["learner"] += time.perf_counter() - mark
        release_after_step()
        self.progress("learner", 1, 1)
        await self.worker.step_weights()
        if report.metrics is not None:
            phases["learner_train"] = report.metrics.step_time_s
        if self.gate is not None:
            # The learner's own time (its publish time less the hold) beyond what the loop waited for
            # it: what ran beside the next step's generation.
            held = self.gate.take_held()
            own = sum(report.timings.values()) - held
            phases["learner_publish_held"] = held
            phases["learner_overlapped"] = max(0.0, own - phases["learner"])
        mark = time.perf_counter()
        probed = await self.parts.memory.probe_pending(self.parts.pool)
        stats = await self.parts.memory.stats()
        phases["stats"] = time.perf_counter() - mark
        figures: dict[str, Any] = {}
        if evaluator is not None and evaluator.due(generated.step):
            mark = time.perf_counter()
            figures = await evaluator(generated.step, self.learner.version)
            phases["eval"] = time.perf_counter() - mark
        infos = await self.parts.client.model_info()
        # What the server serves now (a learner publishing every version: the learner's version).
        served = [int(v) for v in (i.weight_version for i in infos) if v is not None and v.isdigit()]
        self.served_version = min(served, default=self.learner.version)
        busy, counts = self.clock.take()  # the publication, the probes, the evaluation
        for name, seconds in generated.busy.items():
            busy[name] = busy.get(name, 0.0) + seconds
        for name, count in generated.counts.items():
            counts[name] = counts.get(name, 0) + count
        phases.update(busy)
        record = step_metrics(
            generated.step,
            spec_id=self.spec.spec_id,
            batch=generated.batch,
            plays=generated.plays,
            report=report,
            stats=stats,
            weight_version=",".join(str(i.weight_version) for i in infos),
            elapsed_s=time.monotonic() - self.start,
            phases=phases,
            counts=counts,
            evaluation=figures,
        )
        record.update(process_memory())
        record["pool/probed_this_step"] = probed
        record["pool/chosen_this_step"] = len(generated.chosen)
        record["pool/retired_no_signal"] = len(self.choice.retired)
        if not record.get("learner/trained"):
            record["learner/why_not_trained"] = why_not_trained(record)
        return record

    async def steps(self, evaluator: InRunEval | None, write: Callable[[dict[str, Any], Generated], None]) -> None:
        """Run every step, each line written (``write``) as its learner step is done.

        Sequential: generate, train, finish, one step after another. Overlapped (``gate`` set): step
        ``n + 1`` generates on the weights step ``n`` started from while step ``n`` trains, its
        publication held until that generation is done; the last step's training is waited for.
        """
        pending: tuple[Generated, asyncio.Task[StepReport]] | None = None
        try:
            self.progress("step", 0, self.settings.steps)
            for step in range(1, self.settings.steps + 1):
                generated = await self.generate(step)
                if pending is not None:
                    write(await self.finish(*pending, evaluator), pending[0])
                    pending = None
                training = await self.start_training(generated, hold=step < self.settings.steps)
                pending = (generated, training)
                if self.gate is None:
                    write(await self.finish(generated, training, evaluator), generated)
                    pending = None
            if pending is not None:
                write(await self.finish(*pending, evaluator), pending[0])
                pending = None
        finally:
            if pending is not None:  # a step failed (or the run was cancelled) while one trained
                if self.gate is not None:
                    self.gate.open.set()
                pending[1].cancel()
                (outcome,) = await asyncio.gather(pending[1], return_exceptions=True)
                if isinstance(outcome, Exception):
                    log.error("the learner's step %d failed as well: %r", pending[0].step, outcome)


async def run(
    settings: RunSettings, progress: Progress = _no_progress, on_step: StepListener | None = None
) -> RunResult:
    """Run ``settings.steps`` self-play steps and write the run directory (see the module docstring).

    Raises:
        RunSetupError: The run cannot start as configured (a static pool with nothing valid, a model
            whose context is too short, a designer pool that is not a directory of answers).
    """
    from services.embedded.departures import departures
    from services.embedded.evaluation import InRunEval, held_out_difference
    from services.learner.wiring import build_learner, close_learner
    from services.rollout.sandbox import PoolSessions
    from services.rollout.wiring import rollout_worker

    settings = await _with_policy(settings, progress)
    spec = run_spec(settings)
    result = RunResult(run_dir=settings.run_dir, spec_id=spec.spec_id)
    settings.run_dir.mkdir(parents=True, exist_ok=True)
    (settings.run_dir / "config.json").write_text(settings.model_dump_json(indent=2))
    (settings.run_dir / "run_spec.json").write_text(spec.to_json())
    metrics_path = settings.run_dir / "metrics.jsonl"
    rewards_path = settings.run_dir / "designer_rewards.jsonl"
    start = time.monotonic()
    clock = PhaseClock()
    progress("start", 0, 1)
    async with embedded_system(settings) as parts:
        progress("start", 1, 1)
        roles = role_settings(settings, inference_url=parts.server.url, model=parts.model, admin_key=parts.admin_key)
        check_context(settings, roles, parts.model)
        if settings.overlap_learner and roles.learner.max_staleness < 1:
            raise RunSetupError(
                "overlap_learner trains each step while the next one generates, one weight version behind the "
                f"learner, but the learner's max_staleness is {roles.learner.max_staleness}: every play would "
                "be dropped; set learner.max_staleness >= 1 or overlap_learner: false"
            )
        result.departures = departures(settings)
        if settings.seed_pool:
            result.seeded = await seed_pool(settings, parts, spec.spec_id)
            log.info("seed pool: %d envs", len(result.seeded))
        if settings.pool is not None:
            result.static = await static_pool(settings, parts, spec.spec_id)
            log.info("static pool %s: %d envs", settings.pool, len(result.static))
        designer = build_run_designer(settings, roles, spec, parts, clock)
        tapped = TappedMemory(parts.memory, clock)
        scored: list[ScoredAttempt] = []
        learner = build_learner(roles.learner, spec=spec, queue=parts.queue, on_designer_reward=scored.append)
        gate = None
        if learner.publisher is not None:
            learner.publisher = Timed(learner.publisher, clock, "publish_reload")  # type: ignore[assignment]
            if settings.overlap_learner:
                gate = PublishGate(learner.publisher)
                learner.publisher = gate  # type: ignore[assignment]
        evaluator = InRunEval(settings, parts) if settings.eval_every or settings.held_out_eval else None

        def write(record: dict[str, Any], generated: Generated | None = None) -> None:
            if generated is not None and generated.scored:
                with rewards_path.open("a") as fh:
                    fh.writelines(
                        json.dumps(_reward_row(generated.step, s), default=str) + "\n" for s in generated.scored
                    )
            if generated is not None:
                result.weight_version = learner.version
                progress("step", generated.step, settings.steps)
            result.steps.append(record)
            with metrics_path.open("a") as fh:
                fh.write(json.dumps(record, default=str) + "\n")
            if on_step is not None:
                on_step(record)

        try:
            if evaluator is not None:
                progress("eval", 0, 1)
                await evaluator.snapshot_pool()
                figures = await evaluator(0, learner.version)
                write({"step": 0, "elapsed_s": round(time.monotonic() - start, 1), "spec_id": spec.spec_id, **figures})
                progress("eval", 1, 1)
            async with rollout_worker(
                roles.rollout,
                spec=spec,
                queue=parts.queue,
                memory=tapped,
                sessions=Timed(PoolSessions(parts.pool, parts.checks), clock, "sandbox", wrap_results=True),
                inference=Timed(parts.client, clock, "rollout_generation"),  # type: ignore[arg-type]
            ) as worker:
                loop = StepLoop(
                    settings=settings,
                    spec=spec,
                    parts=parts,
                    designer=designer,
                    learner=learner,
                    worker=worker,
                    tapped=tapped,
                    clock=clock,
                    choice=PoolChoice(
                        [*result.seeded, *result.static],
                        per_step=settings.pool_envs_per_step,
                        retire_after=settings.pool_retire_after,
                    ),
                    scored=scored,
                    gate=gate,
                    progress=progress,
                    start=start,
                    served_version=learner.version,
                )
                await loop.steps(evaluator, write)
                result.audit_retired = [(v.env_id, v.reason) for v in await worker.store.audits(trivially_won=True)]
        finally:
            await close_learner(learner, close_queue=False)
        envs = await export_pool(parts.memory, settings.run_dir / "envs.jsonl")
    if evaluator is not None and settings.held_out_eval:
        result.held_out = held_out_difference(settings.run_dir, settings.steps)
    result.checkpoint = last_checkpoint(settings.run_dir / "checkpoints", settings.run_dir / "last_checkpoint")
    result.report = _write_report(settings, spec, result, envs, time.monotonic() - start)
    return result


async def _with_policy(settings: RunSettings, progress: Progress) -> RunSettings:
    """``settings`` with the policy the run starts from: ``model_path`` when given, else the default
    model, warm-started (``spade warmstart``, built once and cached) unless ``designer_init`` is base.

    Raises:
        RunSetupError: The warm start could not be built (nothing passed validation).
    """
    if settings.model_path is not None or settings.designer_init == "base":
        return settings
    from services.embedded.warmstart import WarmStartSettings, warm_start
    from services.embedded.warmstart.build import WarmStartError

    warm = WarmStartSettings.from_run(settings, eval_base=False)  # `spade warmstart` measures the base model

    def labelled(phase: str, done: float, total: float) -> None:
        # Built once per machine and cached; its bars say whose they are (a first run spends minutes here).
        progress(f"warm start: {phase}", done, total)

    try:
        path = await warm_start(warm, progress=labelled)
    except WarmStartError as exc:
        raise RunSetupError(f"the designer warm start failed: {exc}; pass --designer-init base to skip it") from None
    release_freed_memory()  # the warm start's fine-tune, when it ran in this process
    log.info("policy: the warm-started model at %s", path)
    return settings.model_copy(update={"model_path": path})


def _write_report(
    settings: RunSettings, spec: RunSpec, result: RunResult, envs: list[dict[str, Any]], wall_s: float
) -> Path:
    from services.embedded.metrics import held_out_sentence, summary_sentences
    from services.embedded.report import ReportContext, write_report

    designer_kind = (
        "off"
        if settings.designer_mode == "off"
        else ("pool (answers from files)" if settings.designer_pool else settings.designer_mode)
    )
    summary = summary_sentences(
        [r for r in result.steps if r.get("step")],
        designer_mode=settings.designer_mode,
        pool_designer=settings.designer_pool is not None,
        seeded=len(result.seeded),
        static=len(result.static),
    )
    if result.held_out is not None:
        summary.insert(0, held_out_sentence(result.held_out))
    context = ReportContext(
        summary=summary,
        facts={
            "run dir": str(settings.run_dir),
            "setting": settings.setting,
            "preset": settings.preset or "none (the embedded default)",
            "designer": designer_kind,
            "model": str(settings.model_path or "SmolLM2-135M-Instruct (the base model)"),
            "run spec id": spec.spec_id,
            "served weights": served_weights(settings),
            "steps": settings.steps,
            "weight version": result.weight_version,
            "environments in pool": len(envs),
            "last checkpoint": str(result.checkpoint or "none"),
            "wall time (s)": round(wall_s, 1),
        },
        departures=result.departures,
        audit_retired=result.audit_retired,
    )
    return write_report(settings.run_dir, envs, context)
