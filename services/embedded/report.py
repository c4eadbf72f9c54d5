"""The run report: ``metrics.jsonl`` rendered as one self-contained HTML page with SVG charts.

Readable without knowing the numbers: a plain-language summary on top (what the designer wrote, what
the agent trained on, how its return moved), the run's departures from the paper, then charts with
titled axes, units, gridlines and honest scales — rates always on [0, 1], regret on [-1, 1], counts
and other values from 0 (a constant-zero series is drawn at a labelled 0, and a small change is never
stretched over the whole height) — and finally the environment pool. No script, no external asset:
the page renders offline in any browser.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

Scale = Literal["rate", "signed", "count", "value"]
"""``rate``: [0, 1]; ``signed``: [-1, 1]; ``count`` and ``value``: from 0 (or the lowest negative value)
to the highest value, with round ticks."""

PALETTE = ("#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#4b5563", "#ca8a04", "#db2777")
WIDTH, HEIGHT = 440, 250
LEFT, RIGHT, TOP, BOTTOM = 58, 14, 14, 42


@dataclass(frozen=True)
class Line:
    """One series of a line chart: a metric key and how the legend names it."""

    key: str
    label: str
    dashed: bool = False


@dataclass(frozen=True)
class Chart:
    """One chart of the report.

    Attributes:
        id: Stable id (``data-chart`` in the page; the browser test looks for each).
        title: Caption.
        y_label: The y axis title, with its unit.
        scale: See :data:`Scale`.
        lines: Line series (a line chart).
        bars_prefix: Stacked bars of every key with this prefix, per step (a bar chart).
        empty: What "no data" means for this chart (shown when nothing is plotted).
        note: One sentence under the chart on how to read it.
    """

    id: str
    title: str
    y_label: str
    scale: Scale
    lines: tuple[Line, ...] = ()
    bars_prefix: str = ""
    empty: str = "no value was recorded"
    note: str = ""


SECTIONS: tuple[tuple[str, tuple[Chart, ...]], ...] = (
    (
        "Designer",
        (
            Chart(
                "designer-outcomes",
                "Designer attempts per step, by outcome",
                "attempts",
                "count",
                bars_prefix="designer/outcome/",
                empty="no designer round ran",
                note="valid = stored and played; any other colour names the check that failed, or malformed / "
                "duplicate.",
            ),
            Chart(
                "designer-validity",
                "Designer validity rate",
                "valid attempts / attempts",
                "rate",
                (Line("designer/validity_rate", "this step"), Line("designer/total/validity_rate", "all so far", True)),
                empty="no designer attempt",
            ),
            Chart(
                "designer-reward",
                "Designer reward of scored samples (mean)",
                "reward term (0–1)",
                "rate",
                (
                    Line("designer/blend_mean", "blend"),
                    Line("designer/regret_norm_mean", "regret_norm"),
                    Line("designer/plateau_mean", "plateau"),
                    Line("designer/window_win_rate_mean", "window win rate", True),
                ),
                empty="no designer sample was scored (a window closes k versions after its env is designed)",
                note="blend = 0.4 · regret_norm + 0.6 · plateau(window win rate); invalid attempts score 0 "
                "(or, with validity shaping, a penalty of at most 0: never more than a valid env).",
            ),
            Chart(
                "designer-advantage",
                "Advantages",
                "fraction / mean |advantage|",
                "value",
                (
                    Line("designer/advantage_nonzero_frac", "designer: nonzero fraction"),
                    Line("designer/advantage_abs_mean", "designer: mean |adv|"),
                    Line("agent/advantage_abs_mean", "agent: mean |adv|", True),
                ),
                empty="the learner computed no advantage",
                note="designer advantage = blend minus the mean blend of its skill in its round.",
            ),
        ),
    ),
    (
        "Agent",
        (
            Chart(
                "agent-return",
                "Agent return beside solved rate",
                "mean return / fraction solved",
                "rate",
                (
                    Line("agent/win_rate", "mean return (no hint)"),
                    Line("agent/solved_fraction", "solved (no hint)", True),
                    Line("agent/hinted_win_rate", "mean return (hint)"),
                    Line("agent/hinted_solved_fraction", "solved (hint)", True),
                ),
                empty="the agent played nothing",
                note="returns lie in [0, 1]; the win rate is the mean return, solved counts returns of 1.",
            ),
            Chart(
                "agent-finish",
                "How plays ended, per step",
                "plays",
                "count",
                bars_prefix="agent/finish/",
                empty="the agent played nothing",
                note="fault_* = the env hit a resource limit (counted as return 0, not trained on by default).",
            ),
        ),
    ),
    (
        "The signal from this step's plays",
        (
            Chart(
                "play-regret",
                "Hint-based regret (envs played in both arms)",
                "hinted − unhinted mean return",
                "signed",
                (Line("play/regret_mean", "this step's envs"), Line("designer/regret_mean", "scored samples", True)),
                empty="no env was played in both arms this step",
            ),
            Chart(
                "play-plateau",
                "Plateau and learnable fraction",
                "plateau (0–1) / fraction of envs",
                "rate",
                (
                    Line("play/plateau_mean", "plateau(win rate), mean"),
                    Line("play/learnable_fraction", "learnable (win rate in [0.2, 0.8])"),
                ),
                empty="no env was played without the hint",
            ),
        ),
    ),
    (
        "The pool's process metrics",
        (
            Chart(
                "pool-rates",
                "Pool quality",
                "fraction",
                "rate",
                (
                    Line("pool/learnable_fraction", "learnable, all scored envs"),
                    Line("pool/learnable_fraction_window", "learnable, recent window", True),
                    Line("pool/vendi_per_n", "Vendi score / n"),
                    Line("pool/leakage_share", "leaks the answer"),
                ),
                empty="the memory reported no pool figure",
                note="Vendi / n near 1: envs unlike each other; 1/n: all alike.",
            ),
            Chart(
                "pool-counts",
                "Pool size",
                "environments / documents",
                "count",
                (
                    Line("pool/envs", "envs in the pool"),
                    Line("pool/hash_distinct", "distinct code"),
                    Line("pool/distinct_documents", "distinct corpus documents"),
                    Line("pool/scored", "scored", True),
                    Line("pool/audit_retired", "retired by the audit (trivially won)", True),
                ),
                empty="the memory reported no pool figure",
            ),
            Chart(
                "pool-shape",
                "Pool envs' shape (means)",
                "count",
                "value",
                (
                    Line("pool/reward_levels_mean", "reward levels"),
                    Line("pool/interaction_turns_mean", "turns per play"),
                    Line("pool/hidden_state_size_mean", "hidden-state attributes"),
                ),
                empty="no pool env was played or probed",
            ),
            Chart(
                "pool-program",
                "Program length (mean)",
                "lines of code",
                "count",
                (Line("pool/program_lines_mean", "lines"),),
                empty="the pool is empty",
            ),
        ),
    ),
    (
        "Learner",
        (
            Chart(
                "learner-loss",
                "GRPO loss",
                "loss (per token)",
                "value",
                (Line("learner/loss", "loss"),),
                empty="the learner never trained",
            ),
            Chart(
                "learner-health",
                "Update health",
                "value",
                "value",
                (
                    Line("learner/grad_norm", "gradient norm"),
                    Line("learner/clip_fraction", "clipped fraction", True),
                    Line("learner/logp_diff_mean", "|logp learner − rollout|"),
                ),
                empty="the learner never trained",
            ),
            Chart(
                "learner-staleness",
                "Staleness of trained samples",
                "weight versions behind",
                "count",
                (
                    Line("learner/staleness/agent_mean", "agent, mean"),
                    Line("learner/staleness/agent_max", "agent, max", True),
                    Line("learner/staleness/designer_mean", "designer, mean"),
                ),
                empty="the learner never trained",
            ),
        ),
    ),
    (
        "Evaluation",
        (
            Chart(
                "eval",
                "Held-out evaluation",
                "mean score",
                "rate",
                empty="no in-run evaluation (spade run --eval-every N --eval-suite NAME)",
                note="the shaded band is the bootstrap 95% interval of the overall mean.",
            ),
        ),
    ),
    (
        "Where the time went",
        (
            Chart(
                "time",
                "Wall time per step, by phase",
                "seconds",
                "count",
                bars_prefix="time/",
                empty="no phase was timed",
            ),
        ),
    ),
)
"""Every chart of the report, by section."""


def chart_ids() -> list[str]:
    """The ``data-chart`` ids every report contains."""
    return [chart.id for _, charts in SECTIONS for chart in charts]


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Read one JSON object per line, skipping blank lines."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def series(records: Iterable[Mapping[str, Any]], key: str) -> list[tuple[float, float]]:
    """``(step, value)`` pairs of ``key`` over the records that have a finite value for it."""
    out = []
    for record in records:
        value = _finite(record.get(key))
        step = _finite(record.get("step"))
        if value is not None and step is not None:
            out.append((step, value))
    return out


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """Round tick values covering ``[low, high]`` (1, 2, 2.5 or 5 times a power of ten apart).

    >>> nice_ticks(0, 1)
    [0.0, 0.25, 0.5, 0.75, 1.0]
    >>> nice_ticks(0, 7)
    [0.0, 2.0, 4.0, 6.0, 8.0]
    """
    span = high - low
    if span <= 0:
        span = abs(high) or 1.0
    raw = span / max(1, count - 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw - 1e-12)
    start = math.floor(low / step + 1e-9) * step
    end = math.ceil(high / step - 1e-9) * step
    return [round(start + i * step, 12) + 0.0 for i in range(round((end - start) / step) + 1)]


def y_domain(scale: Scale, values: Sequence[float]) -> tuple[float, float, list[float]]:
    """The y range and ticks of a chart: fixed for rates, from 0 otherwise (honest scales).

    >>> y_domain("rate", [0.01, 0.02])[:2]
    (0.0, 1.0)
    >>> y_domain("count", [0, 0, 0])[:2]
    (0.0, 1.0)
    """
    if scale == "rate":
        return 0.0, 1.0, [0.0, 0.25, 0.5, 0.75, 1.0]
    if scale == "signed":
        return -1.0, 1.0, [-1.0, -0.5, 0.0, 0.5, 1.0]
    low = min([0.0, *values])
    high = max([0.0, *values])
    if high == low:
        high = low + 1.0
    ticks = nice_ticks(low, high)
    return ticks[0], ticks[-1], ticks


def _fmt(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.3g}"


class _Frame:
    """The plotting area of one chart: scales and the axes, ticks and gridlines."""

    def __init__(self, x0: float, x1: float, y0: float, y1: float) -> None:
        self.x0, self.x1, self.y0, self.y1 = x0, x1, y0, y1

    def sx(self, x: float) -> float:
        return LEFT + (x - self.x0) / (self.x1 - self.x0) * (WIDTH - LEFT - RIGHT)

    def sy(self, y: float) -> float:
        return HEIGHT - BOTTOM - (y - self.y0) / (self.y1 - self.y0) * (HEIGHT - TOP - BOTTOM)

    def axes(self, y_ticks: Sequence[float], x_ticks: Sequence[float], y_label: str) -> str:
        parts = []
        for y in y_ticks:
            py = self.sy(y)
            stroke = "#9ca3af" if y == 0 else "#e5e7eb"
            parts.append(f'<line x1="{LEFT}" y1="{py:.1f}" x2="{WIDTH - RIGHT}" y2="{py:.1f}" stroke="{stroke}"/>')
            parts.append(f'<text x="{LEFT - 6}" y="{py + 3.5:.1f}" font-size="10" text-anchor="end">{_fmt(y)}</text>')
        for x in x_ticks:
            px = self.sx(x)
            parts.append(
                f'<line x1="{px:.1f}" y1="{TOP}" x2="{px:.1f}" y2="{HEIGHT - BOTTOM}" stroke="#f3f4f6"/>'
                f'<text x="{px:.1f}" y="{HEIGHT - BOTTOM + 14}" font-size="10" text-anchor="middle">{x:g}</text>'
            )
        parts.append(
            f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{HEIGHT - BOTTOM}" stroke="#6b7280"/>'
            f'<line x1="{LEFT}" y1="{HEIGHT - BOTTOM}" x2="{WIDTH - RIGHT}" y2="{HEIGHT - BOTTOM}" stroke="#6b7280"/>'
            f'<text x="{(LEFT + WIDTH - RIGHT) / 2}" y="{HEIGHT - 6}" font-size="11" text-anchor="middle">'
            "learner step</text>"
            f'<text transform="translate(13,{(TOP + HEIGHT - BOTTOM) / 2}) rotate(-90)" font-size="11" '
            f'text-anchor="middle">{html.escape(y_label)}</text>'
        )
        return "".join(parts)


def _steps(records: Sequence[Mapping[str, Any]]) -> list[float]:
    return sorted({s for s in (_finite(r.get("step")) for r in records) if s is not None})


def _x_ticks(steps: Sequence[float]) -> list[float]:
    if len(steps) <= 12:
        return list(steps)
    stride = math.ceil(len(steps) / 10)
    return list(steps[::stride])


def _svg(body: str, label: str) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" '
        f'role="img" aria-label="{html.escape(label)}">{body}</svg>'
    )


def _empty(chart: Chart) -> str:
    frame = _Frame(0, 1, 0, 1)
    body = frame.axes([], [], chart.y_label) + (
        f'<text x="{(LEFT + WIDTH - RIGHT) / 2}" y="{(TOP + HEIGHT - BOTTOM) / 2}" text-anchor="middle" '
        f'font-size="11" fill="#6b7280">no data: {html.escape(chart.empty)}</text>'
    )
    return _svg(body, chart.title)


def line_chart(chart: Chart, records: Sequence[Mapping[str, Any]], lines: Sequence[Line] | None = None) -> str:
    """An SVG line chart of ``lines`` (default: the chart's) over the records' steps."""
    lines = list(lines if lines is not None else chart.lines)
    data = [(line, series(records, line.key)) for line in lines]
    data = [(line, pts) for line, pts in data if pts]
    if not data:
        return _empty(chart)
    steps = _steps(records)
    x0, x1 = (steps[0] - 1, steps[0] + 1) if len(steps) == 1 else (steps[0], steps[-1])
    values = [y for _, pts in data for _, y in pts]
    band = _bands(chart, records)
    values += [v for lo_hi in band.values() for _, lo, hi in lo_hi for v in (lo, hi)]
    y0, y1, ticks = y_domain(chart.scale, values)
    frame = _Frame(x0, x1, y0, y1)
    parts = [frame.axes(ticks, _x_ticks(steps), chart.y_label)]
    for i, (line, pts) in enumerate(data):
        color = PALETTE[i % len(PALETTE)]
        for key, triples in band.items():
            if key == line.key and triples:
                upper = " ".join(f"{frame.sx(x):.1f},{frame.sy(hi):.1f}" for x, _, hi in triples)
                lower = " ".join(f"{frame.sx(x):.1f},{frame.sy(lo):.1f}" for x, lo, _ in reversed(triples))
                parts.append(f'<polygon points="{upper} {lower}" fill="{color}" fill-opacity="0.15"/>')
        path = " ".join(f"{'M' if j == 0 else 'L'}{frame.sx(x):.1f},{frame.sy(y):.1f}" for j, (x, y) in enumerate(pts))
        dash = ' stroke-dasharray="5 3"' if line.dashed else ""
        parts.append(f'<path d="{path}" fill="none" stroke="{color}" stroke-width="2"{dash}/>')
        parts.extend(
            f'<circle cx="{frame.sx(x):.1f}" cy="{frame.sy(y):.1f}" r="3" fill="{color}">'
            f"<title>{html.escape(line.label)}, step {x:g}: {y:.4g}</title></circle>"
            for x, y in pts
        )
    return _svg("".join(parts), chart.title) + _legend([(line.label, line.dashed) for line, _ in data])


def _bands(chart: Chart, records: Sequence[Mapping[str, Any]]) -> dict[str, list[tuple[float, float, float]]]:
    """Interval bands: ``KEY_low``/``KEY_high`` around a line ``KEY`` (the eval's bootstrap interval)."""
    out: dict[str, list[tuple[float, float, float]]] = {}
    for line in chart.lines:
        triples = []
        for record in records:
            step, lo, hi = (_finite(record.get(k)) for k in ("step", f"{line.key}_low", f"{line.key}_high"))
            if step is not None and lo is not None and hi is not None:
                triples.append((step, lo, hi))
        if triples:
            out[line.key] = triples
    return out


def bar_chart(chart: Chart, records: Sequence[Mapping[str, Any]]) -> str:
    """Stacked bars per step of every key starting with ``chart.bars_prefix``."""
    prefix = chart.bars_prefix
    keys = sorted({k for r in records for k, v in r.items() if k.startswith(prefix) and _finite(v)})
    keys.sort(key=lambda k: (k != f"{prefix}valid", k != f"{prefix}terminated", k))
    if not keys:
        return _empty(chart)
    steps = _steps(records)
    totals = [sum(_finite(r.get(k)) or 0.0 for k in keys) for r in records]
    y0, y1, ticks = y_domain(chart.scale, totals)
    frame = _Frame(steps[0] - 0.5, steps[-1] + 0.5, y0, y1)
    width = max(4.0, (frame.sx(1) - frame.sx(0)) * 0.6) if len(steps) > 1 else 60.0
    width = min(width, 60.0)
    parts = [frame.axes(ticks, _x_ticks(steps), chart.y_label)]
    colors = {k: _bar_color(k.removeprefix(prefix), i) for i, k in enumerate(keys)}
    for record in records:
        step = _finite(record.get("step"))
        if step is None:
            continue
        base = 0.0
        for key in keys:
            value = _finite(record.get(key)) or 0.0
            if value <= 0:
                continue
            top, bottom = frame.sy(base + value), frame.sy(base)
            label = key.removeprefix(prefix)
            parts.append(
                f'<rect x="{frame.sx(step) - width / 2:.1f}" y="{top:.1f}" width="{width:.1f}" '
                f'height="{max(0.5, bottom - top):.1f}" fill="{colors[key]}">'
                f"<title>{html.escape(label)}, step {step:g}: {value:g}</title></rect>"
            )
            base += value
    return _svg("".join(parts), chart.title) + _legend(
        [(k.removeprefix(prefix), False) for k in keys], colors=[colors[k] for k in keys]
    )


_FIXED_COLORS = {"valid": "#16a34a", "terminated": "#16a34a", "malformed": "#6b7280", "duplicate": "#a3a3a3"}


_NOT_GREEN = ("#dc2626", "#ea580c", "#9333ea", "#0891b2", "#ca8a04", "#db2777", "#2563eb", "#7c2d12", "#4338ca")
"""Colours of failed checks and other outcomes: never the green of ``valid`` / ``terminated``."""


def _bar_color(label: str, index: int) -> str:
    if label in _FIXED_COLORS:
        return _FIXED_COLORS[label]
    if label.startswith("fault_"):
        return ("#dc2626", "#b91c1c", "#f97316", "#7f1d1d", "#fb7185")[index % 5]
    return _NOT_GREEN[index % len(_NOT_GREEN)]


def _legend(items: Sequence[tuple[str, bool]], colors: Sequence[str] | None = None) -> str:
    entries = []
    for i, (label, dashed) in enumerate(items):
        color = colors[i] if colors is not None else PALETTE[i % len(PALETTE)]
        style = "border-top-style:dashed" if dashed else ""
        entries.append(f'<span class="key"><i style="border-top-color:{color};{style}"></i>{html.escape(label)}</span>')
    return f'<div class="legend">{"".join(entries)}</div>'


def eval_lines(records: Sequence[Mapping[str, Any]]) -> list[Line]:
    """The eval chart's lines: each ``eval/<suite>/overall`` and category mean in the records."""
    keys = sorted(
        {
            k
            for r in records
            for k in r
            if k.startswith("eval/") and not k.endswith(("_low", "_high", "_n")) and _finite(r.get(k)) is not None
        }
    )
    keys.sort(key=lambda k: (not k.endswith("/overall"), k))
    return [Line(k, k.removeprefix("eval/").replace("/", ": "), dashed=not k.endswith("/overall")) for k in keys]


def render_chart(chart: Chart, records: Sequence[Mapping[str, Any]]) -> str:
    """One chart as a ``<figure>`` with its caption, SVG, legend and note."""
    if chart.bars_prefix:
        body = bar_chart(chart, records)
    elif chart.id == "eval":
        body = line_chart(Chart(**{**chart.__dict__, "lines": tuple(eval_lines(records))}), records)
    else:
        body = line_chart(chart, records)
    note = f'<p class="note">{html.escape(chart.note)}</p>' if chart.note else ""
    return (
        f'<figure data-chart="{chart.id}" id="chart-{chart.id}"><figcaption>{html.escape(chart.title)}</figcaption>'
        f"{body}{note}</figure>"
    )


@dataclass
class ReportContext:
    """What the report says besides the metrics.

    Attributes:
        summary: Plain-language sentences on what happened (top of the page).
        facts: Key facts of the run (run dir, setting, spec id, wall time ...).
        departures: The run's departures from the paper, one sentence each.
        audit_retired: (env id, why) of each env retired as ``trivially_won`` by the audit plays.
    """

    summary: list[str] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)
    departures: list[str] = field(default_factory=list)
    audit_retired: list[tuple[str, str]] = field(default_factory=list)


POOL_COLUMNS = ("env_id", "skill", "status", "source", "plays", "win_rate", "solved_fraction", "regret", "failed_check")


def render_report(records: list[dict[str, Any]], envs: list[dict[str, Any]], context: ReportContext) -> str:
    """The whole page: summary, departures, one section of charts after another, and the pool."""
    summary = "".join(f"<li>{html.escape(s)}</li>" for s in context.summary)
    facts = "".join(
        f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>" for k, v in context.facts.items()
    )
    if context.departures:
        departures = "".join(f"<li>{html.escape(d)}</li>" for d in context.departures)
        departures_html = (
            f"<details open><summary>Departures from the paper ({len(context.departures)})</summary>"
            f"<ul>{departures}</ul></details>"
        )
    else:
        departures_html = "<p>This run uses the paper's values for everything the project can set.</p>"
    retired = "".join(
        f"<tr><td>{html.escape(env_id)}</td><td>{html.escape(why)}</td></tr>" for env_id, why in context.audit_retired
    )
    audit_html = (
        f'<table id="audit"><tr><th>env id</th><th>why</th></tr>{retired}</table>'
        if context.audit_retired
        else "<p>No env was retired: no trivial policy won any env's audit plays too often.</p>"
    )
    sections = "".join(
        f'<section><h2>{html.escape(title)}</h2><div class="grid">'
        + "".join(render_chart(chart, records) for chart in charts)
        + "</div></section>"
        for title, charts in SECTIONS
    )
    env_rows = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_cell(env.get(col)))}</td>" for col in POOL_COLUMNS) + "</tr>"
        for env in envs
    )
    header = "".join(f"<th>{c.replace('_', ' ')}</th>" for c in POOL_COLUMNS)
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>SPADE run report</title>
<style>
body{{font-family:system-ui,sans-serif;margin:2rem;color:#111;max-width:1400px}}
.grid{{display:flex;flex-wrap:wrap;gap:1rem}}
figure{{margin:0;border:1px solid #e5e7eb;padding:.5rem;width:{WIDTH}px}}
figcaption{{font-weight:600;font-size:.9rem;margin-bottom:.25rem}}
.note{{font-size:.75rem;color:#4b5563;margin:.25rem 0 0}}
.legend{{font-size:.75rem;display:flex;flex-wrap:wrap;gap:.25rem .75rem}}
.key i{{display:inline-block;width:18px;border-top:3px solid;margin-right:4px;vertical-align:middle}}
#summary{{font-size:1.05rem;background:#f9fafb;border-left:4px solid #2563eb;padding:.5rem 1rem .5rem 2rem}}
table{{border-collapse:collapse;font-size:.85rem}} td,th{{border:1px solid #ddd;padding:.2rem .5rem;text-align:left}}
</style></head><body>
<h1>SPADE run report</h1>
<ul id="summary">{summary}</ul>
<table id="facts">{facts}</table>
<div id="departures">{departures_html}</div>
{sections}
<section><h2>Retired by the audit plays as trivially won ({len(context.audit_retired)})</h2>
<p class="note">Audit plays: a constant and a random action on each env's own first rollout seeds, no model
call, never trained on. An env a trivial policy won too often is retired and its designer sample scored
invalid.</p>
{audit_html}</section>
<section><h2>Environment pool ({len(envs)})</h2>
<table id="pool"><tr>{header}</tr>{env_rows}</table></section>
</body></html>
"""


def _cell(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def write_report(run_dir: Path, envs: list[dict[str, Any]], context: ReportContext) -> Path:
    """Render ``run_dir/metrics.jsonl`` into ``run_dir/report.html``; returns the page's path."""
    metrics = run_dir / "metrics.jsonl"
    records = read_metrics(metrics) if metrics.exists() else []
    out = run_dir / "report.html"
    out.write_text(render_report(records, envs, context))
    return out
