"""The embedded main job: designer, sandbox, memory, rollout, learner and inference in one process.

The same service code as distributed mode runs here, wired to in-process parts: the isolated
sandbox pool, a SQLite memory, the in-process queue, the embedded SGLang-compatible server (over
HTTP on loopback, so the same inference client is used) and the learner on CPU.

One step of the loop, for weight version ``v``:

1. the designer writes ``envs_per_step`` environments (validated in the sandbox, deduplicated and
   stored in the memory, announced on ``envs.ready``); every attempt becomes a designer sample;
2. the rollout plays each new env on G seeds without and with its hint (the same seeds), and plays
   the envs whose window is still open on fresh seeds without the hint;
3. the learner turns the plays into agent advantages and the closed windows into designer rewards,
   takes one GRPO step, publishes version ``v+1`` to the inference server and announces it.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import shutil
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.embedded.settings import RunSettings, ServiceOverrides
from services.memory.service import MemoryService
from spade.memory.records import Environment, Play, RecordResult, StatsUpdate

if TYPE_CHECKING:  # the parts' modules load torch and the model server: imported when the run starts
    from services.designer.core.loop import Designer
    from services.designer.core.pool import DesignerPool
    from services.designer.settings import DesignerSettings
    from services.inference.wiring import ServerHandle
    from services.learner.core.window import ScoredAttempt
    from services.learner.settings import LearnerSettings
    from services.rollout.settings import RolloutSettings
    from services.sandbox.isolation import SandboxPool
    from spade.envs import CheckConfig, ValidationReport
    from spade.inference.client import InferenceClient
    from spade.queues.inprocess import InProcessQueue
    from spade.runspec import RunSpec

log = logging.getLogger("spade.run")

Progress = Callable[[str, float, float], None]
"""``progress(phase, done, total)``: called as each phase advances (the CLI draws bars from it)."""


def _no_progress(phase: str, done: float, total: float) -> None:
    return None


class RunSetupError(RuntimeError):
    """The run cannot start as configured (the message is one line for a person, naming the fix)."""


class PhaseClock:
    """Busy time and generated tokens per component of the loop, for ``time/...`` in ``metrics.jsonl``.

    Components are timed where the runner hands them to the services (:class:`Timed`); calls that
    overlap (concurrent plays) add up, so a component's busy time can exceed the step's wall time.
    """

    def __init__(self) -> None:
        self.busy: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.tokens: dict[str, int] = defaultdict(int)

    def add(self, component: str, seconds: float, tokens: int = 0) -> None:
        self.busy[component] += seconds
        self.calls[component] += 1
        self.tokens[component] += tokens

    def take(self) -> tuple[dict[str, float], dict[str, int]]:
        """This step's figures, then reset: seconds busy per component (``<component>_busy``) and
        counts (``<component>_calls``, ``<component>_tokens`` generated)."""
        seconds = {f"{name}_busy": busy for name, busy in self.busy.items()}
        counts = {f"{name}_calls": self.calls[name] for name in self.busy}
        counts.update({f"{name}_tokens": tokens for name, tokens in self.tokens.items() if tokens})
        self.busy.clear()
        self.calls.clear()
        self.tokens.clear()
        return seconds, counts


def _generated_tokens(result: Any) -> int:
    if isinstance(result, list | tuple):
        return sum(_generated_tokens(r) for r in result)
    ids = getattr(result, "output_ids", None)
    return len(ids) if isinstance(ids, list | tuple) else 0


class Timed:
    """A stand-in for ``target`` that times each of its coroutine methods under ``component``.

    ``wrap_results`` times the objects those methods return too (a sandbox session's ``step``).
    """

    def __init__(self, target: Any, clock: PhaseClock, component: str, *, wrap_results: bool = False) -> None:
        self._target = target
        self._clock = clock
        self._component = component
        self._wrap = wrap_results

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._target, name)
        if not inspect.iscoroutinefunction(attr):
            return attr

        async def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                result = await attr(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
            self._clock.add(self._component, elapsed, _generated_tokens(result))
            return Timed(result, self._clock, self._component) if self._wrap else result

        return timed


class TappedMemory:
    """The memory as the rollout uses it, keeping a copy of every play recorded in this step."""

    def __init__(self, memory: MemoryService, clock: PhaseClock | None = None) -> None:
        self.memory = memory
        self.plays: list[Play] = []
        self._clock = clock

    def _took(self, start: float) -> None:
        if self._clock is not None:
            self._clock.add("rollout_memory", time.perf_counter() - start)

    async def get_environment(self, env_id: str) -> Environment:
        start = time.perf_counter()
        try:
            return await self.memory.get_environment(env_id)
        finally:
            self._took(start)

    async def record_plays(self, plays: Sequence[Play]) -> RecordResult:
        self.plays.extend(plays)
        start = time.perf_counter()
        try:
            return await self.memory.record_plays(plays)
        finally:
            self._took(start)

    async def set_window(self, env_id: str, window_start: int, window_versions: int) -> Environment:
        start = time.perf_counter()
        try:
            return await self.memory.set_window(env_id, window_start, window_versions)
        finally:
            self._took(start)

    async def update_stats(self, env_id: str, update: StatsUpdate) -> Environment:
        start = time.perf_counter()
        try:
            return await self.memory.update_stats(env_id, update)
        finally:
            self._took(start)


@dataclass
class EmbeddedParts:
    """What every role of the embedded system shares (built by ``embedded_system``).

    Attributes:
        model: The policy's checkpoint directory (weights and tokenizer).
        server: The embedded inference server, running in a thread of this process.
        client: The inference client every role generates through (over loopback HTTP).
        pool: The sandbox's isolated worker pool (validation and play sessions).
        checks: The limits validation and sessions run with.
        memory: The memory's application layer over a SQLite file in the run directory.
        queue: The in-process implementation of the work queues.
    """

    model: Path
    server: ServerHandle
    client: InferenceClient
    pool: SandboxPool
    checks: CheckConfig
    memory: MemoryService
    queue: InProcessQueue


@dataclass(frozen=True)
class RoleSettings:
    """Each role's own settings, derived from the run's and overridden by its per-service sections."""

    designer: DesignerSettings
    rollout: RolloutSettings
    learner: LearnerSettings


@dataclass
class RunResult:
    """What a run left behind.

    Attributes:
        run_dir: The run directory.
        steps: Each step's ``metrics.jsonl`` line.
        report: ``report.html``.
        checkpoint: ``last_checkpoint/`` (None when no checkpoint was written).
        weight_version: The learner's version at the end.
        spec_id: The run spec's id.
        seeded: Env ids of the seed pool.
        static: Env ids of the static pool.
        departures: The run's departures from the paper.
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


@contextlib.asynccontextmanager
async def embedded_system(settings: RunSettings) -> AsyncIterator[EmbeddedParts]:
    """Start every part of the system in this process; stop all of it on exit."""
    from services.inference.settings import InferenceSettings
    from services.inference.wiring import serve_in_thread
    from services.memory.settings import MemorySettings
    from services.memory.wiring import build_service
    from services.sandbox.isolation import SandboxPool
    from spade.inference.client import InferenceClient
    from spade.inference.models import resolve_model_path
    from spade.queues.inprocess import InProcessQueue

    run_dir = settings.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    model = resolve_model_path(settings.model_path)
    async with contextlib.AsyncExitStack() as stack:
        inference_settings = InferenceSettings(
            **_with_overrides(
                {"model_path": model, "http": {"port": 0}, "torch_threads": settings.torch_threads}, settings.inference
            )
        )
        server = serve_in_thread(inference_settings)
        stack.callback(server.stop)
        client = InferenceClient([server.url], tokenizer_path=model, timeout_s=1800.0)
        stack.push_async_callback(client.aclose)
        await client.wait_ready()

        pool = SandboxPool(settings.isolation)
        await pool.start()
        stack.push_async_callback(pool.stop)

        memory_settings = MemorySettings(
            dev_mode=True,
            database_url=f"sqlite:///{(run_dir / 'memory.db').resolve()}",
            window_versions_game=settings.window_versions if settings.setting == "game" else None,
            window_versions_tool=settings.window_versions if settings.setting == "tool" else None,
            window=settings.memory_window,
            content_env_ids=True,  # the memory is this run's own: a rerun plays the same seeds
        )
        memory = build_service(memory_settings)
        stack.callback(memory.store.engine.dispose)

        queue = InProcessQueue()
        stack.push_async_callback(queue.close)
        yield EmbeddedParts(
            model=model, server=server, client=client, pool=pool, checks=settings.checks, memory=memory, queue=queue
        )


async def seed_pool(settings: RunSettings, parts: EmbeddedParts) -> list[str]:
    """Store the contract's example envs (validated in the sandbox) for the whole run."""
    from services.memory.seed_pool import seed_pool as load_seed_pool

    async def validate(code: str, setting: str) -> ValidationReport:
        return await parts.pool.validate(code, setting, parts.checks)

    # The seed pool stays active for the whole run (designed envs use k), so the agent always has
    # something to play, even while the designer cannot yet write a valid env.
    return await load_seed_pool(
        settings.setting, parts.memory, parts.queue, window_versions=settings.steps + 1, validate=validate
    )


async def static_pool(settings: RunSettings, parts: EmbeddedParts, spec_id: str) -> list[str]:
    """Validate, store and announce ``settings.pool`` for the whole run (``--pool FILE_OR_DIR``).

    Raises:
        RunSetupError: The pool cannot be read or no env of it passed validation.
    """
    from services.embedded.pools import StaticPoolError, read_static_pool, store_static_pool

    assert settings.pool is not None

    async def validate(code: str, setting: str) -> ValidationReport:
        return await parts.pool.validate(code, setting, parts.checks)

    try:
        envs = read_static_pool(settings.pool, settings.setting)
        stored = await store_static_pool(
            envs,
            source=str(settings.pool),
            memory=parts.memory,
            queue=parts.queue,
            validate=validate,
            window_versions=settings.steps + 1,
            spec_id=spec_id,
        )
    except StaticPoolError as exc:
        raise RunSetupError(str(exc)) from None
    for name, checks in stored.rejected:
        log.warning("static pool: %s left out, it failed %s", name, ", ".join(checks))
    return stored.stored


def model_context(model: Path) -> int | None:
    """The model's context length (``max_position_embeddings`` of its ``config.json``), if it says."""
    try:
        config = json.loads((model / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = config.get("max_position_embeddings")
    return int(value) if isinstance(value, int) else None


def check_context(settings: RunSettings, roles: RoleSettings, model: Path) -> None:
    """Refuse a run whose token budgets do not fit the model's context (one line naming the fix).

    Raises:
        RunSetupError: The designer's context or the agent's trajectory is longer than the model's.
    """
    context = model_context(model)
    if context is None:
        return
    problems = []
    if roles.designer.context_tokens > context:
        problems.append(
            f"the designer's context_tokens={roles.designer.context_tokens} (prompt "
            f"{roles.designer.max_prompt_tokens} + answer {settings.designer_max_new_tokens})"
        )
    if settings.agent_max_total_tokens > context:
        problems.append(f"agent_max_total_tokens={settings.agent_max_total_tokens}")
    if problems:
        raise RunSetupError(
            f"the model at {model} has a {context}-token context, shorter than {' and '.join(problems)}: "
            "pass --model-path to a model with a longer context (the paper presets need 32768, Qwen3), or set "
            "designer.context_tokens, designer_max_prompt_tokens, designer_max_new_tokens and "
            "agent_max_total_tokens to fit"
        )


def _with_overrides(derived: dict[str, Any], overrides: ServiceOverrides) -> dict[str, Any]:
    """The run's derived values for one service, with that service's section of ``RunSettings`` on top."""
    return {**derived, **overrides.values()}


def role_settings(settings: RunSettings, *, inference_url: str, model: Path) -> RoleSettings:
    """Every role's settings: what the run's knobs imply, then the run's per-service overrides.

    Args:
        settings: The run's settings.
        inference_url: The embedded inference server every role talks to.
        model: The policy's checkpoint (tokenizer for designer and rollout, base weights for the learner).

    Raises:
        pydantic.ValidationError: The overrides break a rule of the service's settings across fields.
    """
    from services.designer.settings import DesignerSettings
    from services.learner.settings import LearnerSettings
    from services.rollout.settings import RolloutSettings

    run_dir = settings.run_dir.resolve()
    designer = DesignerSettings(
        **_with_overrides(
            {
                "dev_mode": True,
                "setting": settings.setting,
                "max_attempts_per_env": settings.designer_attempts,
                "max_prompt_tokens": settings.designer_max_prompt_tokens,
                "regenerate_every": settings.regenerate_every,
                "frozen": settings.designer_mode == "frozen",
                "criteria_reachable": {"enabled": False},  # off in the embedded run (a setting)
                "inference_urls": [inference_url],
                "tokenizer_path": model,
                **({} if settings.corpus else {"doc_max_words": 0, "doc_min_words": 0}),
                **({} if settings.memory_examples else {"n_positive": 0, "n_negative": 0}),
            },
            settings.designer,
        )
    )
    rollout = RolloutSettings(
        **_with_overrides(
            {
                "dev_mode": True,
                "queue": {"kind": "inprocess"},
                "state_url": f"sqlite:///{run_dir / 'rollout.db'}",
                "block_ms": 50,
                "inference_urls": [inference_url],
                "tokenizer_path": model,
            },
            settings.rollout,
        )
    )
    learner = LearnerSettings(
        **_with_overrides(
            {
                "dev_mode": True,
                "model_path": model,
                "checkpoint_dir": run_dir / "checkpoints",
                "weights_dir": run_dir / "weights",
                "keep_checkpoints": 1,
                "keep_weights": 2,
                "checkpoint_every": 1,
                "lr": settings.lr,
                "device": "cpu",
                "fill_timeout_s": 1.0,
                "inference_urls": [inference_url],
                "queue": {"kind": "inprocess"},
            },
            settings.learner,
        )
    )
    return RoleSettings(designer=designer, rollout=rollout, learner=learner)


def run_spec(settings: RunSettings) -> RunSpec:
    """The run's spec: what every role of this run agrees on (G, k, the agent's budget, sampling)."""
    from spade.runspec import RewardConstants, RunSpec

    return RunSpec(
        temperature=settings.temperature,
        group_size=settings.group_size,
        **{f"window_versions_{settings.setting}": settings.window_versions},  # the other setting's k is unused
        agent_max_turns=settings.agent_max_turns,
        agent_max_tokens_per_turn=settings.agent_max_tokens_per_turn,
        agent_max_total_tokens=settings.agent_max_total_tokens,
        designer_max_new_tokens=settings.designer_max_new_tokens,
        envs_per_round=settings.envs_per_step,
        skills_per_round=settings.skills_per_round,
        rewards=RewardConstants(validity_shaping_weight=settings.validity_shaping),
    )


StepListener = Callable[[dict[str, Any]], None]
"""``on_step(record)``: called with each step's ``metrics.jsonl`` line as it is written."""


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
            validity_fraction=components.validity_fraction,
            blend=components.blend,
        )
    return row


def _designer(
    settings: RunSettings, roles: RoleSettings, spec: RunSpec, parts: EmbeddedParts, clock: PhaseClock
) -> Designer | DesignerPool | None:
    """The run's designer: the policy's (trained, or frozen), the pool designer, or none (``off``)."""
    from services.designer.adapters import InferencePolicy, MemoryServiceEnvironments, PoolValidator
    from services.designer.wiring import build_designer, build_pool_designer

    if settings.designer_mode == "off":
        return None
    llm: Any = Timed(InferencePolicy(parts.client), clock, "designer_generation")
    validator: Any = Timed(PoolValidator(parts.pool, parts.checks), clock, "validation")
    memory: Any = Timed(MemoryServiceEnvironments(parts.memory), clock, "designer_memory")
    if settings.designer_pool is not None:
        try:
            return build_pool_designer(
                roles.designer,
                settings.designer_pool,
                spec=spec,
                validator=validator,
                memory=memory,
                queue=parts.queue,
                llm=llm,
            )
        except ValueError as exc:
            raise RunSetupError(str(exc)) from None
    return build_designer(roles.designer, spec=spec, llm=llm, validator=validator, memory=memory, queue=parts.queue)


async def run(
    settings: RunSettings, progress: Progress = _no_progress, on_step: StepListener | None = None
) -> RunResult:
    """Run ``settings.steps`` self-play steps and write the run directory (see the module docstring).

    Raises:
        RunSetupError: The run cannot start as configured (a static pool with nothing valid, a model
            whose context is too short, a designer pool that is not a directory of answers).
    """
    from services.embedded.evaluation import InRunEval
    from services.embedded.metrics import step_metrics, summary_sentences
    from services.embedded.presets import departures
    from services.embedded.report import ReportContext, write_report
    from services.learner.wiring import build_learner, close_learner
    from services.rollout.sandbox import PoolSessions
    from services.rollout.wiring import rollout_worker

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
        roles = role_settings(settings, inference_url=parts.server.url, model=parts.model)
        check_context(settings, roles, parts.model)
        result.departures = departures(settings)
        if settings.seed_pool:
            result.seeded = await seed_pool(settings, parts)
            log.info("seed pool: %d example envs", len(result.seeded))
        if settings.pool is not None:
            result.static = await static_pool(settings, parts, spec.spec_id)
            log.info("static pool %s: %d envs", settings.pool, len(result.static))
        designer = _designer(settings, roles, spec, parts, clock)
        tapped = TappedMemory(parts.memory, clock)
        scored: list[ScoredAttempt] = []
        learner = build_learner(roles.learner, spec=spec, queue=parts.queue, on_designer_reward=scored.append)
        if learner.publisher is not None:
            learner.publisher = Timed(learner.publisher, clock, "publish_reload")  # type: ignore[assignment]
        evaluator = InRunEval(settings, parts) if settings.eval_every else None

        def write(record: dict[str, Any]) -> None:
            result.steps.append(record)
            with metrics_path.open("a") as fh:
                fh.write(json.dumps(record, default=str) + "\n")
            if on_step is not None:
                on_step(record)

        try:
            if evaluator is not None:
                await evaluator.snapshot_pool()
                figures = await evaluator(0, learner.version)
                write({"step": 0, "elapsed_s": round(time.monotonic() - start, 1), "spec_id": spec.spec_id, **figures})
            async with rollout_worker(
                roles.rollout,
                spec=spec,
                queue=parts.queue,
                memory=tapped,
                sessions=Timed(PoolSessions(parts.pool, parts.checks), clock, "sandbox", wrap_results=True),
                inference=Timed(parts.client, clock, "rollout_generation"),  # type: ignore[arg-type]
            ) as worker:
                for step in range(1, settings.steps + 1):
                    progress("step", step - 1, settings.steps)
                    tapped.plays.clear()
                    scored.clear()
                    phases: dict[str, float] = {}
                    batch = None
                    engine = parts.server.engine.work  # the server's own busy time (requests overlap)
                    engine_mark = (engine.busy_s, engine.prefill_s, engine.decode_s)
                    mark = time.perf_counter()
                    if designer is not None and (step - 1) % settings.regenerate_every == 0:
                        progress("designer", 0, 1)
                        round_index = (step - 1) // settings.regenerate_every
                        batch = await designer.run_batch(round_index=round_index, weight_version=learner.version)
                        progress("designer", 1, 1)
                    phases["designer"], mark = time.perf_counter() - mark, time.perf_counter()
                    progress("rollout", 0, 1)
                    await worker.step_weights()
                    while await worker.step_envs():
                        pass
                    while await worker.step_window():
                        pass
                    progress("rollout", 1, 1)
                    phases["rollout"], mark = time.perf_counter() - mark, time.perf_counter()
                    progress("learner", 0, 1)
                    report = await learner.run_step()
                    progress("learner", 1, 1)
                    phases["learner"], mark = time.perf_counter() - mark, time.perf_counter()
                    await worker.step_weights()
                    probed = await parts.memory.probe_pending(parts.pool)
                    stats = await parts.memory.stats()
                    phases["stats"], mark = time.perf_counter() - mark, time.perf_counter()
                    figures = {}
                    if evaluator is not None and evaluator.due(step):
                        figures = await evaluator(step, learner.version)
                        phases["eval"] = time.perf_counter() - mark
                    infos = await parts.client.model_info()
                    version = ",".join(str(i.weight_version) for i in infos)
                    busy, counts = clock.take()
                    phases.update(busy)
                    for part, before in zip(("busy", "prefill", "decode"), engine_mark, strict=True):
                        phases[f"inference_{part}"] = getattr(engine, f"{part}_s") - before
                    if report is not None and report.metrics is not None:
                        phases["learner_train"] = report.metrics.step_time_s
                    record = step_metrics(
                        step,
                        spec_id=spec.spec_id,
                        batch=batch,
                        plays=tapped.plays,
                        report=report,
                        stats=stats,
                        weight_version=version,
                        elapsed_s=time.monotonic() - start,
                        phases=phases,
                        counts=counts,
                        evaluation=figures,
                    )
                    record["pool/probed_this_step"] = probed
                    if scored:
                        with rewards_path.open("a") as fh:
                            fh.writelines(json.dumps(_reward_row(step, s), default=str) + "\n" for s in scored)
                    write(record)
                    result.weight_version = learner.version
                    progress("step", step, settings.steps)
        finally:
            await close_learner(learner, close_queue=False)
        envs = await export_pool(parts.memory, settings.run_dir / "envs.jsonl")
    result.checkpoint = _last_checkpoint(settings.run_dir / "checkpoints", settings.run_dir / "last_checkpoint")
    designer_kind = (
        "off"
        if settings.designer_mode == "off"
        else ("pool (answers from files)" if settings.designer_pool else settings.designer_mode)
    )
    context = ReportContext(
        summary=summary_sentences(
            [r for r in result.steps if r.get("step")],
            designer_mode=settings.designer_mode,
            pool_designer=settings.designer_pool is not None,
            seeded=len(result.seeded),
            static=len(result.static),
        ),
        facts={
            "run dir": str(settings.run_dir),
            "setting": settings.setting,
            "preset": settings.preset or "none (the embedded default)",
            "designer": designer_kind,
            "run spec id": spec.spec_id,
            "steps": settings.steps,
            "weight version": result.weight_version,
            "environments in pool": len(envs),
            "last checkpoint": str(result.checkpoint or "none"),
            "wall time (s)": round(time.monotonic() - start, 1),
        },
        departures=result.departures,
    )
    result.report = write_report(settings.run_dir, envs, context)
    return result


async def export_pool(memory: MemoryService, path: Path) -> list[dict[str, Any]]:
    """Write every stored env (code, hint, report, stats) as JSONL; return the rows for the report."""
    rows: list[dict[str, Any]] = []
    cursor: str | None = None
    with path.open("w") as fh:
        while True:
            page = await memory.list_environments(limit=200, cursor=cursor)
            for env in page.items:
                failed = [c["name"] for c in env.validation_report.get("checks", []) if not c.get("passed")]
                row = {
                    "env_id": env.id,
                    "setting": env.setting,
                    "skill": env.skill,
                    "status": str(env.status),
                    "source": env.corpus_ref.split(":")[0]
                    if env.corpus_ref.startswith(("seed", "static"))
                    else "designer",
                    "env_class": env.env_class,
                    "weight_version": env.weight_version,
                    "win_rate": env.stats.win_rate,
                    "solved_fraction": env.stats.solved_fraction,
                    "regret": env.stats.regret,
                    "regret_note": env.stats.regret_note,
                    "plays": env.stats.plays,
                    "failed_check": failed[0] if failed else "",
                    "corpus_ref": env.corpus_ref,
                }
                fh.write(json.dumps({**row, "code": env.code, "hint": env.hint}) + "\n")
                rows.append(row)
            cursor = page.next_cursor
            if not cursor:
                return rows


def _source(corpus_ref: str) -> str:
    """Where a stored env came from: ``seed pool``, ``static pool`` or ``designer``."""
    head = corpus_ref.split(":", 1)[0]
    return head if head in ("seed pool", "static pool") else "designer"


def _last_checkpoint(checkpoints: Path, target: Path) -> Path | None:
    """Copy the newest checkpoint to ``target`` (the run's 'last checkpoint'), if there is one."""
    if not checkpoints.exists():
        return None
    found = sorted(p for p in checkpoints.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not found:
        return None
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(found[-1], target)
    return target
