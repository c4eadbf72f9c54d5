"""The paper's settings as presets (``spade run --preset paper-game|paper-tool``) and as files.

One definition: :data:`PAPER` holds every value with its source (a section of the reference study,
/work/shared/REFERENCE.md in the project's notes, or the issue that fixed it). From it come

- the embedded preset: values of :class:`~services.embedded.settings.RunSettings` that lie under the
  run's config file, environment and flags (``--preset`` is the lowest layer);
- the distributed files under ``configs/``: ``configs/paper-game.yaml`` (the same run as a
  ``spade run --config`` file) and ``configs/paper-game/`` (``runspec.yaml`` for ``spade runspec set``,
  and ``designer.yaml``, ``learner.yaml``, ``memory.yaml`` for each service's ``--config``), written by
  ``python -m services.embedded.presets configs`` and checked equal to this module by a test;
- the departures of any run from the paper (``services/embedded/departures.py``), listed in
  ``spade run --help``, on the console at start and in the report, so a small run's differences are
  never silent.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from spade.envs.types import Setting

PresetName = Literal["paper-game", "paper-tool"]
PRESETS: tuple[PresetName, ...] = ("paper-game", "paper-tool")


@dataclass(frozen=True)
class PaperValue:
    """One value of the paper's setup.

    Attributes:
        path: Where it lives in ``RunSettings`` (``group_size``, ``learner.loss.kl_coef``).
        game: The value for the game setting.
        tool: The value for the tool setting.
        source: Where the value comes from (a REFERENCE.md section or an issue).
        services: Where it goes in distributed mode: ``runspec.<field>``, ``designer.<field>``,
            ``learner.<field>``, ``memory.<field>`` (empty: embedded only).
    """

    path: str
    game: Any
    tool: Any
    source: str
    services: tuple[str, ...] = ()

    def value(self, setting: str) -> Any:
        return self.game if setting == Setting.GAME else self.tool


_GRPO_GAME = {"type": "grpo", "eps_low": 0.2, "eps_high": 0.28, "tis": True, "tis_cap": 2.0, "kl_coef": 0.0}
_GRPO_TOOL = {**_GRPO_GAME, "kl_coef": 0.005}

PAPER: tuple[PaperValue, ...] = (
    # --- the run spec: what every service agrees on --------------------------------------------------
    PaperValue("temperature", 0.6, 0.6, "REFERENCE §6: temperature 0.6 for both roles", ("runspec.temperature",)),
    PaperValue(
        "group_size",
        16,
        16,
        "REFERENCE §3: 16 hinted plays per env (issue 10: G = 16 per arm, both arms on the same seeds)",
        ("runspec.group_size",),
    ),
    PaperValue(
        "window_versions",
        4,
        8,
        "REFERENCE §3: k = the regeneration interval, 4 for games, 8 for tool use at 8B/30B",
        ("runspec.window_versions_{setting}",),
    ),
    PaperValue("agent_max_turns", 25, 25, "REFERENCE §6: 25 turns", ("runspec.agent_max_turns",)),
    PaperValue(
        "agent_max_tokens_per_turn",
        8192,
        8192,
        "REFERENCE §6: actor 8192 tokens",
        ("runspec.agent_max_tokens_per_turn",),
    ),
    PaperValue(
        "agent_max_total_tokens", 32768, 32768, "REFERENCE §6: context 32768", ("runspec.agent_max_total_tokens",)
    ),
    PaperValue(
        "designer_max_new_tokens",
        16384,
        16384,
        "REFERENCE §6: ED 16384 tokens (20000 at 8B)",
        ("runspec.designer_max_new_tokens",),
    ),
    PaperValue(
        "envs_per_step",
        24,
        24,
        "REFERENCE §6: 24 envs per regeneration (rollout_batch_size)",
        ("runspec.envs_per_round",),
    ),
    PaperValue(
        "skills_per_round",
        3,
        3,
        "REFERENCE §5: select_active_skills rotates 3 of the 6 skills per regeneration (8 envs per skill)",
        ("runspec.skills_per_round",),
    ),
    PaperValue(
        "validity_shaping",
        0.0,
        0.0,
        "REFERENCE §3: invalid attempts get no reward (the blend has no validity term)",
        ("runspec.rewards.validity_shaping_weight",),
    ),
    # --- the loop -----------------------------------------------------------------------------------
    PaperValue("steps", 400, 400, "REFERENCE §6: 400 rollouts"),
    PaperValue(
        "regenerate_every",
        4,
        8,
        "REFERENCE §3, §6: a new round every k rollouts (k = 4 games, 8 tool use)",
        ("designer.regenerate_every",),
    ),
    PaperValue("seed_pool", False, False, "REFERENCE §6: the pool starts empty; every env is designed"),
    PaperValue(
        "overlap_learner",
        False,
        False,
        "REFERENCE §8: slime's colocated loop rolls out, then trains, then syncs the weights: every rollout "
        "on the weights just trained",
    ),
    PaperValue(
        "designer_init",
        "base",
        "base",
        "REFERENCE §6: the policy (Qwen3) writes valid envs from the prompt alone; no supervised warm start",
    ),
    PaperValue(
        "designer_attempts",
        5,
        5,
        "issue 10 (paper preset): 5 attempts per slot",
        ("designer.max_attempts_per_env",),
    ),
    PaperValue(
        "designer.attempts_at_once",
        1,
        1,
        "REFERENCE §2 (7. Retry): each attempt after the previous one failed",
        ("designer.attempts_at_once",),
    ),
    PaperValue(
        "designer_max_prompt_tokens",
        16384,
        16384,
        "REFERENCE §6: context 32768 minus the ED's 16384 tokens: the document budget as large as the context allows",
        ("designer.max_prompt_tokens",),
    ),
    PaperValue(
        "designer.context_tokens",
        32768,
        32768,
        "REFERENCE §6: context 32768 (Qwen3)",
        ("designer.context_tokens",),
    ),
    PaperValue(
        "designer.doc_max_words",
        6000,
        4000,
        "REFERENCE §5: documents cut to 6000 words (games), 4000 (tool use)",
        ("designer.doc_max_words",),
    ),
    PaperValue(
        "designer.excerpt_chars",
        2000,
        2000,
        "REFERENCE §4: memory records keep the first 2000 characters of code",
        ("designer.excerpt_chars", "memory.excerpt_chars"),
    ),
    PaperValue(
        "designer.criteria_reachable.enabled",
        False,
        True,
        "REFERENCE §7: the tool setting's LLM validator asks whether each criterion is reachable",
        ("designer.criteria_reachable.enabled",),
    ),
    PaperValue("memory_window", 200, 200, "REFERENCE §4: --spade-env-memory-max-size 200", ("memory.window",)),
    # --- the learner ----------------------------------------------------------------------------------
    PaperValue("lr", 1e-6, 1e-6, "REFERENCE §6: Adam, lr 1e-6 constant", ("learner.lr",)),
    PaperValue("learner.weight_decay", 0.1, 0.1, "REFERENCE §6: weight decay 0.1", ("learner.weight_decay",)),
    PaperValue("learner.beta1", 0.9, 0.9, "REFERENCE §6: betas (0.9, 0.98)", ("learner.beta1",)),
    PaperValue("learner.beta2", 0.98, 0.98, "REFERENCE §6: betas (0.9, 0.98)", ("learner.beta2",)),
    PaperValue(
        "learner.loss",
        _GRPO_GAME,
        _GRPO_TOOL,
        "REFERENCE §6: clip 0.2 / 0.28, TIS capped at 2 (§3), low-variance KL 0.005 for tool use and 0 for "
        "games at 4B/30B",
        ("learner.loss",),
    ),
)
"""Every value of the paper's setup this project can set, with its source."""

WHY: Mapping[str, str] = {
    "overlap_learner": "on a 2-core CPU a step's training runs beside the next step's generation (three default "
    "steps 142 and 172 s one after another -> 138 and 150 s overlapped, Zen 4 VM, 2026-12-07); those plays are one "
    "weight version behind, which truncated importance sampling corrects",
    "steps": "a run that ends on a laptop (each step costs minutes on CPU)",
    "envs_per_step": "CPU generation: a round of 2 envs is 10-29 s of a default step on 2 cores (2026-12-07)",
    "skills_per_round": "with 2 envs per round, one skill keeps a pair to centre each designer blend on",
    "designer_attempts": "fewer CPU generations per slot",
    "designer.attempts_at_once": "a slot's retry decodes beside its first attempt in one CPU batch instead of after it "
    "failed; the samples are the same (docs/designer.md)",
    "designer_max_new_tokens": "CPU generation time (640 fits every environment family's answer, 345-540 tokens)",
    "designer_max_prompt_tokens": "CPU prefill and training time of every designer sample (SmolLM2's context is 8192)",
    "designer.context_tokens": "SmolLM2-135M's context is 8192 tokens",
    "designer.doc_max_words": "the prompt budget of a small context",
    "designer.excerpt_chars": "the prompt budget of a small context",
    "group_size": "fewer plays per step on CPU",
    "window_versions": "a window closes within a short run, so designer samples get scored",
    "regenerate_every": "a designer round every step, so a short run sees several rounds",
    "agent_max_turns": "CPU generation time (the seed pool's envs end well within 3 turns when played well)",
    "agent_max_tokens_per_turn": "a \\boxed{} action is short; CPU generation time",
    "agent_max_total_tokens": "CPU training cost per sequence",
    "seed_pool": "environment families whose graded returns span a 135M agent's ability: signal to learn from "
    "while a small model cannot yet write valid envs",
    "designer_init": "SmolLM2-135M writes no valid env from the prompt alone (0 of 12); a supervised warm start on "
    "validated family answers (spade warmstart, cached) gives the designer valid envs to be rewarded for",
    "validity_shaping": "a small model rarely writes a valid env; a smaller penalty the more checks it passes, "
    "never above a valid env's 0",
    "lr": "the paper's 1e-6 moves a 135M model too little in a few steps",
    "designer.criteria_reachable.enabled": "each verdict is one more CPU generation",
}
"""Why the embedded default departs from the paper, per value (shown with each departure)."""


def preset_setting(name: PresetName) -> Setting:
    """The setting preset ``name`` designs and plays."""
    return Setting.GAME if name == "paper-game" else Setting.TOOL


def preset_values(name: PresetName) -> dict[str, Any]:
    """The ``RunSettings`` values of preset ``name`` (nested sections as dicts).

    >>> preset_values("paper-tool")["learner"]["loss"]["kl_coef"]
    0.005
    """
    setting = preset_setting(name)
    values: dict[str, Any] = {"setting": setting.value}
    for item in PAPER:
        _put(values, item.path, item.value(setting))
    return values


def _put(target: dict[str, Any], path: str, value: Any) -> None:
    head, *rest = path.split(".")
    for part in rest:
        target = target.setdefault(head, {})
        head = part
    target[head] = dict(value) if isinstance(value, dict) else value


def show_value(value: Any) -> str:
    """A paper value as the departures and the config files print it."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {show_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


# --- the files under configs/ ----------------------------------------------------------------------


def distributed_files(name: PresetName) -> dict[str, dict[str, Any]]:
    """The distributed files of preset ``name``: file name -> its settings (without comments)."""
    setting = preset_setting(name)
    files: dict[str, dict[str, Any]] = {"runspec.yaml": {}, "designer.yaml": {"setting": setting.value}}
    files["learner.yaml"] = {}
    files["memory.yaml"] = {}
    for item in PAPER:
        for target in item.services:
            service, _, field = target.format(setting=setting).partition(".")
            _put(files[f"{service}.yaml"], field, item.value(setting))
    return files


def _comments(name: PresetName, service: str | None) -> Iterator[str]:
    setting = preset_setting(name)
    for item in PAPER:
        targets = item.services if service is not None else (item.path,)
        for target in (t.format(setting=setting) for t in targets):
            if service is not None and not target.startswith(f"{service}."):
                continue
            field = target.partition(".")[2] if service is not None else target
            yield f"#   {field} = {show_value(item.value(setting))}: {item.source}"


def render_files(name: PresetName) -> dict[str, str]:
    """Every file of preset ``name`` under ``configs/``, as text (paths relative to ``configs/``)."""
    header = (
        "# Generated by `python -m services.embedded.presets configs` from services/embedded/presets.py;\n"
        "# edit that module, not this file (a test checks they agree).\n"
    )
    out: dict[str, str] = {}
    values = preset_values(name)
    sources = "\n".join(_comments(name, None))
    out[f"{name}.yaml"] = (
        f"{header}# The paper's {values['setting']} setup as `spade run --config` settings (= --preset {name}).\n"
        f"# Sources:\n{sources}\n" + yaml.safe_dump(values, sort_keys=True)
    )
    usage = {
        "runspec.yaml": "spade runspec set configs/{name}/runspec.yaml (the run spec every service reads)",
        "designer.yaml": "spade serve designer --config configs/{name}/designer.yaml",
        "learner.yaml": "spade serve learner --config configs/{name}/learner.yaml",
        "memory.yaml": "spade serve memory --config configs/{name}/memory.yaml",
    }
    for file, data in distributed_files(name).items():
        service = file.removesuffix(".yaml")
        sources = "\n".join(_comments(name, service))
        out[f"{name}/{file}"] = (
            f"{header}# Usage: {usage[file].format(name=name)}\n"
            "# (with the service's own endpoints, keys and queue set in its environment).\n"
            f"# Sources:\n{sources}\n" + yaml.safe_dump(data, sort_keys=True)
        )
    return out


def write_files(directory: Path) -> list[Path]:
    """Write every preset's files under ``directory`` (the repository's ``configs/``)."""
    written = []
    for name in PRESETS:
        for relative, text in render_files(name).items():
            path = directory / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            written.append(path)
    return written


if __name__ == "__main__":  # pragma: no cover - a maintenance command
    for path in write_files(Path(sys.argv[1] if len(sys.argv) > 1 else "configs")):
        print(path)
