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
import json
import logging
import shutil
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.embedded.settings import RunSettings, ServiceOverrides
from services.memory.service import MemoryService
from spade.memory.records import Environment, Play, RecordResult, StatsUpdate

if TYPE_CHECKING:  # the parts' modules load torch and the model server: imported when the run starts
    from services.designer.core.loop import BatchResult
    from services.designer.settings import DesignerSettings
    from services.inference.wiring import ServerHandle
    from services.learner.learner import StepReport
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


class TappedMemory:
    """The memory as the rollout uses it, keeping a copy of every play recorded in this step."""

    def __init__(self, memory: MemoryService) -> None:
        self.memory = memory
        self.plays: list[Play] = []

    async def get_environment(self, env_id: str) -> Environment:
        return await self.memory.get_environment(env_id)

    async def record_plays(self, plays: Sequence[Play]) -> RecordResult:
        self.plays.extend(plays)
        return await self.memory.record_plays(plays)

    async def set_window(self, env_id: str, window_start: int, window_versions: int) -> Environment:
        return await self.memory.set_window(env_id, window_start, window_versions)

    async def update_stats(self, env_id: str, update: StatsUpdate) -> Environment:
        return await self.memory.update_stats(env_id, update)


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
    """What a run left behind."""

    run_dir: Path
    steps: list[dict[str, Any]] = field(default_factory=list)
    report: Path | None = None
    checkpoint: Path | None = None
    weight_version: int = 0


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def step_metrics(
    step: int,
    batch: BatchResult | None,
    plays: Sequence[Play],
    learner_report: StepReport | None,
    inference_version: str,
    elapsed_s: float,
) -> dict[str, Any]:
    """One line of ``metrics.jsonl``: designer, agent and learner figures of a step."""
    unhinted = [p for p in plays if not p.hinted]
    hinted = [p for p in plays if p.hinted]
    flat = learner_report.flat_metrics() if learner_report is not None else {}
    rewards = learner_report.designer_rewards if learner_report is not None else []
    scored = [s.components for s in rewards if s.components is not None]
    learnable = [c for c in scored if c.valid]
    record: dict[str, Any] = {
        "step": step,
        "elapsed_s": round(elapsed_s, 1),
        "designer/attempts": len(batch.records) if batch is not None else 0,
        "designer/valid": len(batch.env_ids) if batch is not None else 0,
        "designer/validity_rate": batch.validity_rate if batch is not None else None,
        "designer/outcomes": dict(batch.outcomes) if batch is not None else {},
        "agent/plays": len(unhinted),
        "agent/hinted_plays": len(hinted),
        "agent/win_rate": _mean([1.0 if p.episode_return >= 1.0 else 0.0 for p in unhinted]),
        "agent/reward_mean": _mean([p.episode_return for p in unhinted]),
        "agent/hinted_reward_mean": _mean([p.episode_return for p in hinted]),
        "designer/scored": len(scored),
        "designer/reward_mean": _mean([c.blend for c in scored]),
        "designer/regret_mean": _mean([c.regret for c in scored if c.regret is not None]),
        "designer/plateau_mean": _mean([c.plateau for c in scored if c.plateau is not None]),
        "designer/learnable_fraction": (
            _mean([1.0 if (c.plateau or 0) > 0 or (c.regret_norm or 0) > 0 else 0.0 for c in learnable])
            if learnable
            else None
        ),
        "learner/trained": learner_report is not None and learner_report.trained,
        "learner/version": learner_report.version if learner_report is not None else None,
        "inference/weight_version": inference_version,
    }
    record.update({f"learner/{k}": v for k, v in flat.items() if not k.startswith(("designer/", "version"))})
    record.update({k: v for k, v in flat.items() if k.startswith(("designer/advantage", "agent/advantage"))})
    return record


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
                "criteria_reachable": {"enabled": False},  # off in the embedded run (a setting)
                "inference_urls": [inference_url],
                "tokenizer_path": model,
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
        window_versions_game=settings.window_versions,
        window_versions_tool=settings.window_versions,
        agent_max_turns=settings.agent_max_turns,
        agent_max_tokens_per_turn=settings.agent_max_tokens_per_turn,
        agent_max_total_tokens=settings.agent_max_total_tokens,
        designer_max_new_tokens=settings.designer_max_new_tokens,
        envs_per_round=settings.envs_per_step,
        skills_per_round=min(3, settings.envs_per_step),
        rewards=RewardConstants(validity_shaping_weight=settings.validity_shaping),
    )


async def run(settings: RunSettings, progress: Progress = _no_progress) -> RunResult:
    """Run ``settings.steps`` self-play steps and write the run directory (see the module docstring)."""
    from services.designer.adapters import InferencePolicy, MemoryServiceEnvironments, PoolValidator
    from services.designer.wiring import build_designer
    from services.embedded.report import write_report
    from services.learner.wiring import build_learner, close_learner
    from services.rollout.sandbox import PoolSessions
    from services.rollout.wiring import rollout_worker

    result = RunResult(run_dir=settings.run_dir)
    settings.run_dir.mkdir(parents=True, exist_ok=True)
    (settings.run_dir / "config.json").write_text(settings.model_dump_json(indent=2))
    metrics_path = settings.run_dir / "metrics.jsonl"
    start = time.monotonic()
    progress("start", 0, 1)
    async with embedded_system(settings) as parts:
        progress("start", 1, 1)
        roles = role_settings(settings, inference_url=parts.server.url, model=parts.model)
        if settings.seed_pool:
            seeded = await seed_pool(settings, parts)
            log.info("seed pool: %d example envs", len(seeded))
        designer = build_designer(
            roles.designer,
            spec=run_spec(settings),
            llm=InferencePolicy(parts.client),
            validator=PoolValidator(parts.pool, parts.checks),
            memory=MemoryServiceEnvironments(parts.memory),
            queue=parts.queue,
        )
        tapped = TappedMemory(parts.memory)
        learner = build_learner(roles.learner, spec=run_spec(settings), queue=parts.queue)
        try:
            async with rollout_worker(
                roles.rollout,
                spec=run_spec(settings),
                queue=parts.queue,
                memory=tapped,
                sessions=PoolSessions(parts.pool, parts.checks),
                inference=parts.client,
            ) as worker:
                for step in range(1, settings.steps + 1):
                    progress("step", step - 1, settings.steps)
                    tapped.plays.clear()
                    progress("designer", 0, 1)
                    batch = await designer.run_batch(round_index=step)
                    progress("designer", 1, 1)
                    progress("rollout", 0, 1)
                    await worker.step_weights()
                    while await worker.step_envs():
                        pass
                    while await worker.step_window():
                        pass
                    progress("rollout", 1, 1)
                    progress("learner", 0, 1)
                    report = await learner.run_step()
                    progress("learner", 1, 1)
                    await worker.step_weights()
                    infos = await parts.client.model_info()
                    version = ",".join(str(i.weight_version) for i in infos)
                    record = step_metrics(step, batch, tapped.plays, report, version, time.monotonic() - start)
                    result.steps.append(record)
                    with metrics_path.open("a") as fh:
                        fh.write(json.dumps(record, default=str) + "\n")
                    result.weight_version = learner.version
                    progress("step", step, settings.steps)
        finally:
            await close_learner(learner, close_queue=False)
        envs = await export_pool(parts.memory, settings.run_dir / "envs.jsonl")
    result.checkpoint = _last_checkpoint(settings.run_dir / "checkpoints", settings.run_dir / "last_checkpoint")
    summary = {
        "run dir": str(settings.run_dir),
        "setting": settings.setting,
        "steps": settings.steps,
        "weight version": result.weight_version,
        "environments in pool": len(envs),
        "last checkpoint": str(result.checkpoint or "none"),
        "wall time (s)": round(time.monotonic() - start, 1),
    }
    result.report = write_report(settings.run_dir, envs, summary)
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
                    "env_class": env.env_class,
                    "weight_version": env.weight_version,
                    "win_rate": env.stats.win_rate,
                    "regret": env.stats.regret,
                    "plays": env.stats.plays,
                    "failed_check": failed[0] if failed else "",
                    "corpus_ref": env.corpus_ref,
                }
                fh.write(json.dumps({**row, "code": env.code, "hint": env.hint}) + "\n")
                rows.append(row)
            cursor = page.next_cursor
            if not cursor:
                return rows


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
