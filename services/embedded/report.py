"""The run report: ``metrics.jsonl`` rendered as one self-contained HTML page with SVG plots."""

from __future__ import annotations

import html
import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

PLOTS: tuple[tuple[str, str], ...] = (
    ("designer/validity_rate", "Designer validity rate"),
    ("agent/win_rate", "Agent win rate (unhinted)"),
    ("designer/regret_mean", "Regret (hinted − unhinted)"),
    ("designer/plateau_mean", "Plateau term"),
    ("designer/learnable_fraction", "Learnable fraction"),
    ("designer/reward_mean", "Designer reward"),
    ("agent/reward_mean", "Agent reward (mean return)"),
    ("learner/loss", "GRPO loss"),
)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Read one JSON object per line, skipping blank lines."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def svg_line_chart(points: Sequence[tuple[float, float]], title: str, width: int = 360, height: int = 200) -> str:
    """A minimal SVG line chart of ``(x, y)`` points with its min/max labelled.

    >>> "<svg" in svg_line_chart([(0, 0.0), (1, 1.0)], "t")
    True
    """
    pad = 32
    if not points:
        body = f'<text x="{width / 2}" y="{height / 2}" text-anchor="middle" fill="#888">no data</text>'
        return _frame(body, title, width, height)
    xs = [p[0] for p in points]
    ys = [p[1] for p in points]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    if y1 == y0:
        y0, y1 = y0 - 0.5, y1 + 0.5

    def sx(x: float) -> float:
        return pad + (x - x0) / (x1 - x0) * (width - 2 * pad)

    def sy(y: float) -> float:
        return height - pad - (y - y0) / (y1 - y0) * (height - 2 * pad)

    path = " ".join(f"{'M' if i == 0 else 'L'}{sx(x):.1f},{sy(y):.1f}" for i, (x, y) in enumerate(points))
    dots = "".join(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.5"/>' for x, y in points)
    body = (
        f'<line x1="{pad}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" stroke="#ccc"/>'
        f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{height - pad}" stroke="#ccc"/>'
        f'<path d="{path}" fill="none" stroke="#2563eb" stroke-width="2"/><g fill="#2563eb">{dots}</g>'
        f'<text x="4" y="{pad + 4}" font-size="10">{y1:.3g}</text>'
        f'<text x="4" y="{height - pad}" font-size="10">{y0:.3g}</text>'
        f'<text x="{pad}" y="{height - 8}" font-size="10">step {x0:g}</text>'
        f'<text x="{width - pad}" y="{height - 8}" font-size="10" text-anchor="end">step {x1:g}</text>'
    )
    return _frame(body, title, width, height)


def _frame(body: str, title: str, width: int, height: int) -> str:
    return (
        f"<figure><figcaption>{html.escape(title)}</figcaption>"
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="{html.escape(title)}">{body}</svg></figure>'
    )


def series(records: Iterable[dict[str, Any]], key: str) -> list[tuple[float, float]]:
    """``(step, value)`` pairs of ``key`` over the records that have a finite value for it."""
    out = []
    for record in records:
        value = _finite(record.get(key))
        step = _finite(record.get("step"))
        if value is not None and step is not None:
            out.append((step, value))
    return out


def render_report(records: list[dict[str, Any]], envs: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    """The whole page: summary, one plot per metric in ``PLOTS``, and the env pool."""
    charts = "".join(svg_line_chart(series(records, key), title) for key, title in PLOTS)
    summary_rows = "".join(
        f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>" for k, v in summary.items()
    )
    env_rows = "".join(
        "<tr>"
        + "".join(
            f"<td>{html.escape(str(env.get(col, '')))}</td>"
            for col in ("env_id", "skill", "status", "env_class", "win_rate", "regret", "failed_check")
        )
        + "</tr>"
        for env in envs
    )
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>SPADE run report</title>
<style>
body{{font-family:system-ui,sans-serif;margin:2rem;color:#111}}
.grid{{display:flex;flex-wrap:wrap;gap:1rem}}
figure{{margin:0;border:1px solid #eee;padding:.5rem}} figcaption{{font-weight:600;font-size:.9rem}}
table{{border-collapse:collapse;font-size:.85rem}} td,th{{border:1px solid #ddd;padding:.2rem .5rem;text-align:left}}
</style></head><body>
<h1>SPADE run report</h1>
<table>{summary_rows}</table>
<h2>Training curves</h2><div class="grid">{charts}</div>
<h2>Environment pool ({len(envs)})</h2>
<table><tr><th>env</th><th>skill</th><th>status</th><th>class</th><th>win rate</th><th>regret</th>
<th>failed check</th></tr>{env_rows}</table>
</body></html>
"""


def write_report(run_dir: Path, envs: list[dict[str, Any]], summary: dict[str, Any]) -> Path:
    """Render ``run_dir/metrics.jsonl`` into ``run_dir/report.html``; returns the page's path."""
    metrics = run_dir / "metrics.jsonl"
    records = read_metrics(metrics) if metrics.exists() else []
    out = run_dir / "report.html"
    out.write_text(render_report(records, envs, summary))
    return out
