"""The departures of a run from the paper: each value that differs from the paper's, with its reason.

Listed in ``spade run --help``, on the console at start and in the report, so a small run's
differences are never silent. The paper's values and the reasons live in ``presets.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.embedded.presets import PAPER, WHY, show_value
from services.embedded.roles import role_settings
from services.embedded.settings import RunSettings


def _get(source: Any, path: str) -> Any:
    for part in path.split("."):
        source = source.get(part) if isinstance(source, dict) else getattr(source, part, None)
    return source


def effective(settings: RunSettings, path: str, roles: Any = None) -> Any:
    """The value ``settings`` runs with at ``path``: a run field, or a field of the role's settings as
    the run builds them (its derived values, its section's overrides, the service's defaults).

    Args:
        settings: The run's settings.
        path: ``group_size``, ``designer.doc_max_words``, ``learner.loss`` ...
        roles: The run's ``RoleSettings`` when already built (default: built here).
    """
    head, _, tail = path.partition(".")
    if head in ("designer", "learner") and tail:
        if roles is None:
            roles = _roles(settings)
        return _plain(_get(getattr(roles, head), tail))
    return getattr(settings, path)


def _roles(settings: RunSettings) -> Any:
    return role_settings(settings, inference_url="http://127.0.0.1:1", model=Path("model"))


def _plain(value: Any) -> Any:
    dump = getattr(value, "model_dump", None)
    return dump(mode="json") if dump is not None else value


def departures(settings: RunSettings) -> list[str]:
    """Each value of ``settings`` that differs from the paper's for its setting, one sentence each.

    A default embedded run lists its budget and the seed pool; ``--preset paper-game`` lists nothing.
    """
    roles = _roles(settings)
    lines = []
    for item in PAPER:
        paper = item.value(settings.setting)
        ours = effective(settings, item.path, roles)
        if _same(ours, paper):
            continue
        why = WHY.get(item.path, "set for this run")
        lines.append(f"{item.path} = {show_value(ours)} (paper: {show_value(paper)}, {item.source}): {why}")
    return lines


def _same(ours: Any, paper: Any) -> bool:
    if isinstance(paper, dict):
        return isinstance(ours, dict) and all(_same(ours.get(k), v) for k, v in paper.items())
    if isinstance(paper, float) and isinstance(ours, int | float):
        return abs(float(ours) - paper) <= 1e-12 * max(1.0, abs(paper))
    return bool(ours == paper)
