"""Example envs, written exactly as the designer should write them, each with its hint.

Tests, docs, the seed pool and the designer's prompts share them through ``EXAMPLES``. Each env is
a ``.py`` file in this folder; ``Example.code`` is its text. All of them pass every check.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from spade.envs.types import Setting

_HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Example:
    """One example env.

    Attributes:
        name: registry key, also the file stem.
        setting: game or tool.
        skill: the skill it exercises (DESIGN §1 skill lists).
        hint: the privileged hint (game: a key insight; tool: a step plan by tool role, no values).
        code: the env source.
    """

    name: str
    setting: Setting
    skill: str
    hint: str
    code: str

    def to_dict(self) -> dict[str, str]:
        return {
            "name": self.name,
            "setting": self.setting.value,
            "skill": self.skill,
            "hint": self.hint,
            "code": self.code,
        }


def _example(name: str, setting: Setting, skill: str, hint: str) -> Example:
    code = (_HERE / f"{name}.py").read_text(encoding="utf-8")
    return Example(name=name, setting=setting, skill=skill, hint=hint, code=code)


EXAMPLES: dict[str, Example] = {
    e.name: e
    for e in (
        _example(
            "code_breaker",
            Setting.GAME,
            "Logical Deduction",
            "Keep the set of codes consistent with every answer so far and guess one of them; a first guess "
            "with two pairs of digits (like 1 1 2 2) splits the possibilities well.",
        ),
        _example(
            "counterfeit_coin",
            Setting.GAME,
            "Causal Inference",
            "Split the coins into three groups and weigh two of them: the scale says which group holds the "
            "fake and, with a second weighing against known-good coins, whether it is heavy or light.",
        ),
        _example(
            "fog_maze",
            Setting.GAME,
            "Spatial Reasoning",
            "Remember every wall you have seen and prefer moves that reduce the distance to the exit; "
            "when blocked, follow one wall instead of retrying the same move.",
        ),
        _example(
            "sequence_oracle",
            Setting.GAME,
            "Pattern Recognition",
            "Query a few more early terms and look at the differences between consecutive terms, at their "
            "ratios, and at odd and even positions separately; settle on the rule that fits every known term "
            "before extrapolating.",
        ),
        _example(
            "number_hunt",
            Setting.GAME,
            "Mathematical Reasoning",
            "Always guess the middle of the range that is still possible: each answer halves it. If the last "
            "guess cannot be certain, pick the middle anyway; it is the closest on average.",
        ),
        _example(
            "order_desk",
            Setting.TOOL,
            "Multi-Step Workflows",
            "1. Look up the customer by name, then list their orders filtered to the requested status. "
            "2. Pick the order the request describes from that list and update its shipping with the method "
            "and the full address object. 3. Tag that same order. 4. Cancel the order the request names, with "
            "the reason that matches what the customer said. Ignore tools unrelated to orders.",
        ),
        _example(
            "clinic_scheduler",
            Setting.TOOL,
            "State Modification",
            "1. Register the patient with a nested patient object (contact details plus insurance). "
            "2. Search the doctor's free slots for the requested weekday. 3. Book the slot the request "
            "describes using the new patient id and the matching reason. 4. Set reminders on the new "
            "appointment with every requested channel and the requested lead time.",
        ),
    )
}
"""Every example env by name."""

__all__ = ["EXAMPLES", "Example"]
