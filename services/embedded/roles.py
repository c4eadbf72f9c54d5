"""Each role's settings and the run spec, as the embedded run derives them from its own settings.

The run's knobs imply most of every service's settings; the run's per-service sections
(``designer``, ``rollout``, ``learner``, ``inference``) go on top (:func:`role_settings`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.embedded.settings import RunSettings
from services.embedded.system import RunSetupError

if TYPE_CHECKING:
    from services.designer.core.loop import Designer
    from services.designer.core.pool import DesignerPool
    from services.designer.settings import DesignerSettings
    from services.embedded.instruments import PhaseClock
    from services.embedded.system import EmbeddedParts
    from services.learner.settings import LearnerSettings
    from services.rollout.settings import RolloutSettings
    from spade.runspec import RunSpec

CPU_MICRO_BATCH_TOKENS = 2048
"""Tokens per forward/backward pass of the embedded learner (the learner's default is 8192, for GPUs).

Measured with SmolLM2-135M on CPU: about 1.5 MB of saved activations per packed token, so a step of
one 8192-token micro-batch peaked at 20.9 GB of the process's memory and a default `make run` was
killed by the kernel on a 24 GB machine in its second step. Micro-batching leaves the gradient
unchanged (the loss is the mean over the whole batch's trained tokens); at 2048 the peak is a
quarter, and a CPU pass costs about the same per token.
"""


@dataclass(frozen=True)
class RoleSettings:
    """Each role's own settings, derived from the run's and overridden by its per-service sections."""

    designer: DesignerSettings
    rollout: RolloutSettings
    learner: LearnerSettings


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


def role_settings(
    settings: RunSettings, *, inference_url: str, model: Path, admin_key: str | None = None
) -> RoleSettings:
    """Every role's settings: what the run's knobs imply, then the run's per-service overrides.

    Args:
        settings: The run's settings.
        inference_url: The embedded inference server every role talks to.
        model: The policy's checkpoint (tokenizer for designer and rollout, base weights for the learner).
        admin_key: The inference server's admin key the run made (``EmbeddedParts.admin_key``): the
            learner's, for publishing weights, unless the learner section sets its own ``inference.api_key``.

    Raises:
        pydantic.ValidationError: The overrides break a rule of the service's settings across fields.
    """
    from services.designer.settings import DesignerSettings
    from services.learner.settings import LearnerSettings
    from services.rollout.settings import RolloutSettings

    run_dir = settings.run_dir.resolve()
    # A slot's attempts all at once (a retry no longer waits for the failed attempt before it), and
    # every slot's at once: the server decodes them in one batch.
    at_once = settings.designer.values().get("attempts_at_once", settings.designer_attempts)
    designer = DesignerSettings(
        **settings.designer.over(
            {
                "dev_mode": True,
                "setting": settings.setting,
                "max_attempts_per_env": settings.designer_attempts,
                "attempts_at_once": at_once,
                "concurrency": min(1024, settings.envs_per_step * at_once),
                "max_prompt_tokens": settings.designer_max_prompt_tokens,
                "regenerate_every": settings.regenerate_every,
                "frozen": settings.designer_mode == "frozen",
                "criteria_reachable": {"enabled": False},  # off in the embedded run (a setting)
                "inference_urls": [inference_url],
                "tokenizer_path": model,
                **({} if settings.corpus else {"doc_max_words": 0, "doc_min_words": 0}),
                **({} if settings.memory_examples else {"n_positive": 0, "n_negative": 0}),
            }
        )
    )
    envs = min(64, max(4, settings.envs_per_step + settings.pool_envs_per_step))
    rollout = RolloutSettings(
        **settings.rollout.over(
            {
                "dev_mode": True,
                "queue": {"kind": "inprocess"},
                "state_url": f"sqlite:///{run_dir / 'rollout.db'}",
                "block_ms": 50,
                "inference_urls": [inference_url],
                "tokenizer_path": model,
                # Every env of a step at once (the step plays them with play_due): an env whose real
                # plays are done may still be waiting for its paced audit, and must not hold back the
                # next env's real plays; and every play of them at once, so the server decodes them in
                # one batch (its max_batch_size bounds the batch; the rest queue there).
                "max_concurrent_envs": envs,
                "max_concurrent_plays": min(64, 2 * settings.group_size * envs),
                # ... and every env's audit at once: audit plays only wait (a real turn's pace each turn).
                "max_concurrent_audit_plays": min(128, max(16, 2 * settings.audit_plays * envs)),
            }
        )
    )
    from spade.cpu_linear import native_bf16

    learner_values = settings.learner.over(
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
            "micro_batch_tokens": CPU_MICRO_BATCH_TOKENS,
            # Mixed precision, as a GPU learner trains: bf16 products, fp32 weights, gradients and Adam.
            "cpu_bf16": native_bf16(),
            "fill_timeout_s": 1.0,
            "inference_urls": [inference_url],
            "queue": {"kind": "inprocess"},
        }
    )
    if admin_key is not None:
        learner_values["inference"] = _with_key(learner_values.get("inference"), admin_key)
    learner = LearnerSettings(**learner_values)
    return RoleSettings(designer=designer, rollout=rollout, learner=learner)


def _with_key(endpoint: Any, key: str) -> Any:
    """The learner's ``inference`` section with ``key`` unless it names a key of its own."""
    values = endpoint.model_dump() if hasattr(endpoint, "model_dump") else dict(endpoint or {})
    if values.get("api_key") is None:
        values["api_key"] = key
    return values


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
        audit_plays=settings.audit_plays,
        audit_max_win_rate=settings.audit_max_win_rate,
    )


def build_run_designer(
    settings: RunSettings, roles: RoleSettings, spec: RunSpec, parts: EmbeddedParts, clock: PhaseClock
) -> Designer | DesignerPool | None:
    """The run's designer: the policy's (trained, or frozen), the pool designer, or none (``off``)."""
    from services.designer.adapters import InferencePolicy, MemoryServiceEnvironments, PoolValidator
    from services.designer.wiring import build_designer, build_pool_designer
    from services.embedded.instruments import Timed

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
