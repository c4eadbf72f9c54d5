"""The run report: ``metrics.jsonl`` rendered as one self-contained HTML page with SVG charts.

Readable without knowing the numbers: a plain-language summary on top (what the designer wrote, what
the agent trained on, how its return moved), the run's departures from the paper, then charts with
titled axes, units, gridlines and honest scales — rates always on [0, 1], regret on [-1, 1], counts
and other values from 0 (a constant-zero series is drawn at a labelled 0, and a small change is never
stretched over the whole height) — and finally the environment pool. No script, no external asset:
the page renders offline in any browser.

This module computes what the page shows (each chart's scales, ticks and pixel geometry as a
:class:`Plot`, the summary, the pool's cells); the jinja2 templates in ``templates/`` lay it out, and
escape every value once on the way.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path
from typing import Any, Literal

from jinja2 import Environment, PackageLoader, StrictUndefined

from services.embedded.metrics import WALL_PHASES

Scale = Literal["rate", "signed", "count", "value"]
"""``rate``: [0, 1]; ``signed``: [-1, 1]; ``count`` and ``value``: from 0 (or the lowest negative value)
to the highest value, with round ticks."""

PALETTE = ("#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#4b5563", "#ca8a04", "#db2777")


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
        bars_keys: Only these keys (each with the prefix) stacked, in this order; empty: every one.
        empty: What "no data" means for this chart (shown when nothing is plotted).
        note: One sentence under the chart on how to read it.
    """

    id: str
    title: str
    y_label: str
    scale: Scale
    lines: tuple[Line, ...] = ()
    bars_prefix: str = ""
    bars_keys: tuple[str, ...] = ()
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
                note="blend = 0.4 · regret_norm + 0.6 · plateau(window win rate above the audit's trivial "
                "policies'); invalid attempts score 0 "
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
                bars_keys=tuple(f"time/{phase}_s" for phase in WALL_PHASES),
                empty="no phase was timed",
                note="the phases of a step, one after another; what ran inside or beside them (each "
                "component's busy time, the learner beside the next step's generation) is in metrics.jsonl.",
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


@dataclass(frozen=True)
class Canvas:
    """Every chart's SVG canvas, in pixels: its size and the edges of the plotting area inside it.

    The margins leave room for the y tick labels and axis title on the left, the x ones below.
    """

    width: int = 440
    height: int = 250
    left: int = 58  # the y axis
    right: int = 426
    top: int = 14
    bottom: int = 208  # the x axis

    @property
    def mid_x(self) -> float:
        return (self.left + self.right) / 2

    @property
    def mid_y(self) -> float:
        return (self.top + self.bottom) / 2


CANVAS = Canvas()


@dataclass(frozen=True)
class Tick:
    """One tick of an axis: where it sits (pixels along its axis) and its label."""

    at: float
    label: str
    zero: bool = False


@dataclass(frozen=True)
class Dot:
    """One value of a line: its position in pixels and the step and value it shows."""

    x: float
    y: float
    step: float
    value: float


@dataclass(frozen=True)
class Trace:
    """One drawn line, with its interval band (the polygon's vertices, in pixels) if it has one."""

    label: str
    color: str
    dashed: bool
    dots: tuple[Dot, ...]
    band: tuple[tuple[float, float], ...] = ()


@dataclass(frozen=True)
class Bar:
    """One segment of a stacked bar: its rectangle in pixels and the key's value at that step."""

    x: float
    y: float
    width: float
    height: float
    color: str
    label: str
    step: float
    value: float


@dataclass(frozen=True)
class Key:
    """One legend entry."""

    label: str
    color: str
    dashed: bool = False


@dataclass(frozen=True)
class Plot:
    """Everything ``templates/charts.html`` draws for one chart, computed here; no keys means no data."""

    chart: Chart
    y_ticks: tuple[Tick, ...] = ()
    x_ticks: tuple[Tick, ...] = ()
    traces: tuple[Trace, ...] = ()
    bars: tuple[Bar, ...] = ()
    keys: tuple[Key, ...] = ()


class _Frame:
    """The plotting area of one chart: data coordinates to pixels, and the ticks placed on it."""

    def __init__(self, x0: float, x1: float, y0: float, y1: float) -> None:
        self.x0, self.x1, self.y0, self.y1 = x0, x1, y0, y1

    def sx(self, x: float) -> float:
        return CANVAS.left + (x - self.x0) / (self.x1 - self.x0) * (CANVAS.right - CANVAS.left)

    def sy(self, y: float) -> float:
        return CANVAS.bottom - (y - self.y0) / (self.y1 - self.y0) * (CANVAS.bottom - CANVAS.top)

    def y_ticks(self, values: Sequence[float]) -> tuple[Tick, ...]:
        return tuple(Tick(self.sy(y), _fmt(y), zero=y == 0) for y in values)

    def x_ticks(self, steps: Sequence[float]) -> tuple[Tick, ...]:
        return tuple(Tick(self.sx(x), f"{x:g}") for x in _x_ticks(steps))


def _steps(records: Sequence[Mapping[str, Any]]) -> list[float]:
    return sorted({s for s in (_finite(r.get("step")) for r in records) if s is not None})


def _x_ticks(steps: Sequence[float]) -> list[float]:
    if len(steps) <= 12:
        return list(steps)
    stride = math.ceil(len(steps) / 10)
    return list(steps[::stride])


def line_plot(chart: Chart, records: Sequence[Mapping[str, Any]], lines: Sequence[Line] | None = None) -> Plot:
    """The geometry of a line chart of ``lines`` (default: the chart's) over the records' steps."""
    lines = list(lines if lines is not None else chart.lines)
    data = [(line, series(records, line.key)) for line in lines]
    data = [(line, pts) for line, pts in data if pts]
    if not data:
        return Plot(chart)
    steps = _steps(records)
    x0, x1 = (steps[0] - 1, steps[0] + 1) if len(steps) == 1 else (steps[0], steps[-1])
    values = [y for _, pts in data for _, y in pts]
    bands = _bands(chart, records)
    values += [v for triples in bands.values() for _, lo, hi in triples for v in (lo, hi)]
    y0, y1, ticks = y_domain(chart.scale, values)
    frame = _Frame(x0, x1, y0, y1)
    traces = []
    for i, (line, pts) in enumerate(data):
        triples = bands.get(line.key, [])
        upper = [(frame.sx(x), frame.sy(hi)) for x, _, hi in triples]
        lower = [(frame.sx(x), frame.sy(lo)) for x, lo, _ in reversed(triples)]
        dots = tuple(Dot(frame.sx(x), frame.sy(y), x, y) for x, y in pts)
        traces.append(Trace(line.label, PALETTE[i % len(PALETTE)], line.dashed, dots, band=(*upper, *lower)))
    return Plot(
        chart,
        frame.y_ticks(ticks),
        frame.x_ticks(steps),
        traces=tuple(traces),
        keys=tuple(Key(t.label, t.color, t.dashed) for t in traces),
    )


def line_chart(chart: Chart, records: Sequence[Mapping[str, Any]], lines: Sequence[Line] | None = None) -> str:
    """An SVG line chart of ``lines`` (default: the chart's) over the records' steps, and its legend."""
    return _draw("chart", line_plot(chart, records, lines))


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


def bar_plot(chart: Chart, records: Sequence[Mapping[str, Any]]) -> Plot:
    """The geometry of stacked bars per step of every key starting with ``chart.bars_prefix``."""
    prefix = chart.bars_prefix
    keys = sorted({k for r in records for k, v in r.items() if k.startswith(prefix) and _finite(v)})
    keys.sort(key=lambda k: (k != f"{prefix}valid", k != f"{prefix}terminated", k))
    if chart.bars_keys:
        keys = [k for k in chart.bars_keys if k in keys]
    if not keys:
        return Plot(chart)
    steps = _steps(records)
    totals = [sum(_finite(r.get(k)) or 0.0 for k in keys) for r in records]
    y0, y1, ticks = y_domain(chart.scale, totals)
    frame = _Frame(steps[0] - 0.5, steps[-1] + 0.5, y0, y1)
    width = max(4.0, (frame.sx(1) - frame.sx(0)) * 0.6) if len(steps) > 1 else 60.0
    width = min(width, 60.0)
    colors = {k: _bar_color(k.removeprefix(prefix), i) for i, k in enumerate(keys)}
    bars = []
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
            x = frame.sx(step) - width / 2
            bars.append(Bar(x, top, width, max(0.5, bottom - top), colors[key], key.removeprefix(prefix), step, value))
            base += value
    return Plot(
        chart,
        frame.y_ticks(ticks),
        frame.x_ticks(steps),
        bars=tuple(bars),
        keys=tuple(Key(k.removeprefix(prefix), colors[k]) for k in keys),
    )


def bar_chart(chart: Chart, records: Sequence[Mapping[str, Any]]) -> str:
    """Stacked bars per step of every key starting with ``chart.bars_prefix``, as SVG, and their legend."""
    return _draw("chart", bar_plot(chart, records))


_FIXED_COLORS = {"valid": "#16a34a", "terminated": "#16a34a", "malformed": "#6b7280", "duplicate": "#a3a3a3"}


_NOT_GREEN = ("#dc2626", "#ea580c", "#9333ea", "#0891b2", "#ca8a04", "#db2777", "#2563eb", "#7c2d12", "#4338ca")
"""Colours of failed checks and other outcomes: never the green of ``valid`` / ``terminated``."""


def _bar_color(label: str, index: int) -> str:
    if label in _FIXED_COLORS:
        return _FIXED_COLORS[label]
    if label.startswith("fault_"):
        return ("#dc2626", "#b91c1c", "#f97316", "#7f1d1d", "#fb7185")[index % 5]
    return _NOT_GREEN[index % len(_NOT_GREEN)]


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


def chart_plot(chart: Chart, records: Sequence[Mapping[str, Any]]) -> Plot:
    """The geometry of one chart of :data:`SECTIONS` over the records."""
    if chart.bars_prefix:
        return bar_plot(chart, records)
    if chart.id == "eval":
        return line_plot(replace(chart, lines=tuple(eval_lines(records))), records)
    return line_plot(chart, records)


def render_chart(chart: Chart, records: Sequence[Mapping[str, Any]]) -> str:
    """One chart as a ``<figure>`` with its caption, SVG, legend and note."""
    return _draw("figure", chart_plot(chart, records))


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
    return (
        _templates()
        .get_template("report.html")
        .render(
            context=context,
            sections=[(title, [chart_plot(chart, records) for chart in charts]) for title, charts in SECTIONS],
            columns=[column.replace("_", " ") for column in POOL_COLUMNS],
            rows=[[_cell(env.get(column)) for column in POOL_COLUMNS] for env in envs],
        )
    )


@cache
def _templates() -> Environment:
    """The report's jinja2 templates (``services/embedded/templates/``), HTML-escaping every value.

    Values are passed raw and escaped once, by the templates: nothing here may call ``html.escape``.
    """
    jinja = Environment(
        loader=PackageLoader("services.embedded", "templates"),
        autoescape=True,
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    jinja.globals["canvas"] = CANVAS
    jinja.filters["num"] = format  # {{ x|num(".1f") }}: a number in Python's format spec
    return jinja


def _draw(macro: Literal["chart", "figure"], plot: Plot) -> str:
    """A macro of ``templates/charts.html``: ``chart`` (SVG and legend) or ``figure`` (with caption and note)."""
    return str(getattr(_templates().get_template("charts.html").module, macro)(plot))


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
