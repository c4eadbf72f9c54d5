"""The run spec: the settings that must agree across services, as one typed, content-addressed record.

Sampling temperature and top_p (the learner's importance ratios assume the rollout's sampling), the
group size G and the window length k (the learner scores the windows the rollout plays), the agent's
turn and token budgets (the designer promises them and validation replays ``solution()`` within
them), the designer's token budget and the reward constants are decided once per run:

- embedded (``spade run``): built once from the run's settings;
- distributed: stored in the memory (``spade runspec set FILE``, or the first service that starts with
  one) and read by every service at start. A service whose own configuration contradicts the stored
  spec refuses to start and names the field (:meth:`RunSpec.contradictions`).

Every work item (env announcements, agent and designer samples, published weights) carries the spec's
:attr:`RunSpec.spec_id`; a learner receiving samples of another spec refuses them with a logged reason.

>>> spec = RunSpec()
>>> spec.window_for("tool"), spec.window_for("game")
(8, 4)
>>> [p.split(" (spec ")[0] for p in spec.contradictions({"temperature": 0.6, "group_size": 4})]
['group_size: this service is configured with 4 but the run spec has 16']
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from spade.envs.types import Setting
from spade.signal import DesignerRewardConfig, PlateauBand


class RewardConstants(BaseModel):
    """The designer blend's constants (DESIGN §5; the defaults are the paper's)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    regret_weight: float = Field(0.4, ge=0.0, le=10.0, description="Weight of regret_norm in the blend.")
    plateau_weight: float = Field(0.6, ge=0.0, le=10.0, description="Weight of plateau(w) in the blend.")
    regret_scale: float = Field(0.15, gt=0.0, le=1.0, description="Regret that saturates regret_norm.")
    plateau_band: tuple[float, float, float, float] = Field(
        (0.15, 0.4, 0.6, 0.85), description="plateau zero_low, low, high, zero_high."
    )
    validity_shaping_weight: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="Validity shaping of invalid attempts: -w * (1 - fraction of checks passed), "
        "never above a valid env's smallest reward 0 (0: off).",
    )

    def to_config(self) -> DesignerRewardConfig:
        """The signal module's configuration (raises when the band is out of order)."""
        return DesignerRewardConfig(
            regret_weight=self.regret_weight,
            plateau_weight=self.plateau_weight,
            regret_scale=self.regret_scale,
            band=PlateauBand(*self.plateau_band),
            validity_shaping_weight=self.validity_shaping_weight,
        )


class RunSpec(BaseModel):
    """What every service of one run must agree on (see the module docstring).

    Defaults are the paper's values (REFERENCE.md §3, §6), except where noted.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(0.6, gt=0.0, le=2.0, description="Sampling temperature of both roles (paper 0.6).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass of both roles.")
    group_size: int = Field(16, ge=2, le=1024, description="G: seeds per env and version, the same in both arms.")
    window_versions_game: int = Field(4, ge=1, le=1000, description="k for game envs (paper: 4).")
    window_versions_tool: int = Field(8, ge=1, le=1000, description="k for tool envs (paper: 8 at 8B/30B).")
    agent_max_turns: int = Field(25, ge=1, le=1000, description="The agent's turn budget per play (paper: 25).")
    agent_max_tokens_per_turn: int = Field(
        8192, ge=1, le=1_000_000, description="Tokens the agent may generate in one turn (paper: 8192)."
    )
    agent_max_total_tokens: int = Field(
        32768, ge=64, le=10_000_000, description="Length cap of one trajectory, prompt included (paper context 32768)."
    )
    designer_max_new_tokens: int = Field(
        16384, ge=32, le=1_000_000, description="Tokens one designer answer may take (paper: 16384)."
    )
    envs_per_round: int = Field(24, ge=1, le=100_000, description="Envs the designer writes per regeneration.")
    skills_per_round: int = Field(3, ge=1, le=6, description="Skills of the setting's six used per round.")
    rewards: RewardConstants = Field(default_factory=RewardConstants, description="The designer blend's constants.")
    audit_plays: int = Field(
        4,
        ge=0,
        le=64,
        description="Audit plays per env and window of each trivial policy (a constant action, a random action "
        "in the env's stated format), played by the rollout at the env's first slot on that slot's first seeds, "
        "with no model call and never trained on; the learner scores no designer sample before its env's "
        "audit verdict (0: no audit, nothing waits for one). DESIGN §4: the check validation cannot game. "
        "4, not 1: graded envs pay random guesses partial credit, and over one play a 0.5 threshold retired "
        "up to 26% of honest seed-pool envs (measured; 3% at 4 plays), for about 0.3-0.4 s of sandbox time "
        "per env (bench/audit_bench.py).",
    )
    audit_max_win_rate: float = Field(
        0.5,
        ge=0.0,
        lt=1.0,
        description="An env whose trivial policy reaches a win rate (spade.signal.win_rate: mean return, a "
        "resource fault counting 0) above this over its audit plays is retired as trivially_won and its "
        "designer sample rescored invalid; each policy is judged on its own plays.",
    )

    @model_validator(mode="after")
    def _consistent(self) -> RunSpec:
        if self.agent_max_tokens_per_turn >= self.agent_max_total_tokens:
            raise ValueError(
                f"agent_max_tokens_per_turn={self.agent_max_tokens_per_turn} must be below "
                f"agent_max_total_tokens={self.agent_max_total_tokens}: the prompt needs room too"
            )
        if self.envs_per_round < self.skills_per_round:
            raise ValueError(
                f"envs_per_round={self.envs_per_round} is below skills_per_round={self.skills_per_round}: "
                "every skill of a round needs at least one env"
            )
        self.rewards.to_config()
        return self

    @property
    def spec_id(self) -> str:
        """Content address: the first 16 hex digits of the SHA-256 of the canonical JSON."""
        canonical = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def window_for(self, setting: str) -> int:
        """k for ``setting``."""
        if setting == Setting.GAME:
            return self.window_versions_game
        if setting == Setting.TOOL:
            return self.window_versions_tool
        raise ValueError(f"unknown setting {setting!r}: expected 'game' or 'tool'")

    def contradictions(self, configured: Mapping[str, Any]) -> list[str]:
        """What a service's own configuration says against this spec, one sentence per field.

        Args:
            configured: spec field name -> the value the service is configured with; ``None`` values
                mean "not configured, take the spec's" and never contradict. Nested reward constants
                are named ``rewards.<field>``.
        """
        problems = []
        for name, given in configured.items():
            if given is None:
                continue
            head, _, tail = name.partition(".")
            expected = getattr(getattr(self, head), tail) if tail else getattr(self, head)
            value = tuple(given) if isinstance(expected, tuple) and isinstance(given, list) else given
            if value != expected:
                problems.append(
                    f"{name}: this service is configured with {value!r} but the run spec has {expected!r} "
                    f"(spec {self.spec_id})"
                )
        return problems

    @classmethod
    def from_json(cls, text: str) -> RunSpec:
        """Parse a stored spec (as written by :meth:`to_json`)."""
        return cls.model_validate_json(text)

    def to_json(self) -> str:
        """Canonical JSON (sorted keys), the stored form."""
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, indent=2)
