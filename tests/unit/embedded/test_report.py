"""The run report: every chart always present, labelled axes, honest scales, the summary on top."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from html.parser import HTMLParser
from typing import Any

from services.embedded.report import (
    SECTIONS,
    Chart,
    Line,
    ReportContext,
    bar_plot,
    chart_ids,
    line_chart,
    render_report,
)

RECORDS = [
    {
        "step": 1,
        "agent/win_rate": 0.31,
        "agent/solved_fraction": 0.25,
        "designer/outcome/malformed": 4,
        "designer/validity_rate": 0.0,
        "learner/loss": 0.0,
        "time/designer_s": 30.0,
        "time/rollout_s": 12.0,
    },
    {
        "step": 2,
        "agent/win_rate": 0.32,
        "agent/solved_fraction": 0.25,
        "designer/outcome/malformed": 3,
        "designer/outcome/smoke": 1,
        "designer/validity_rate": 0.0,
        "learner/loss": 0.0,
        "play/regret_mean": 0.1,
        "eval/pool/overall": 0.4,
        "eval/pool/overall_low": 0.2,
        "eval/pool/overall_high": 0.6,
    },
]


class _Figures(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.charts: list[str] = []
        self.svgs = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if tag == "figure" and found.get("data-chart"):
            self.charts.append(str(found["data-chart"]))
        if tag == "svg":
            self.svgs += 1


def _render(records: Sequence[Mapping[str, Any]]) -> str:
    context = ReportContext(
        summary=["The designer wrote no valid environment in 8 attempts (7 malformed, 1 smoke)."],
        facts={"run spec id": "abc"},
        departures=["lr = 1e-05 (paper: 1e-06, REFERENCE §6): ..."],
    )
    envs = [{"env_id": "e1", "skill": "Optimization", "status": "valid"}]
    return render_report([dict(r) for r in records], envs, context)


def test_every_chart_is_in_the_page_even_without_data() -> None:
    for records in (RECORDS, []):
        page = _render(records)
        parser = _Figures()
        parser.feed(page)
        assert parser.charts == chart_ids() and parser.svgs == len(chart_ids())
        assert 'id="summary"' in page and "wrote no valid environment" in page
        assert "Departures from the paper (1)" in page and "abc" in page
    assert "no data: no env was played in both arms" not in _render(RECORDS)  # step 2 has a regret
    assert "no data: no in-run evaluation" in _render([])


def _labels(svg: str) -> list[str]:
    return re.findall(r'text-anchor="end">([^<]+)</text>', svg)


def test_rates_use_zero_to_one_whatever_the_values() -> None:
    chart = Chart("t", "t", "fraction", "rate", (Line("x", "x"),))
    svg = line_chart(chart, [{"step": 1, "x": 0.31}, {"step": 2, "x": 0.32}])
    assert _labels(svg) == ["0", "0.25", "0.5", "0.75", "1"]  # a change of 0.01 stays small


def test_a_constant_zero_series_is_drawn_at_a_labelled_zero() -> None:
    chart = Chart("t", "t", "loss", "value", (Line("x", "x"),))
    svg = line_chart(chart, [{"step": 1, "x": 0.0}, {"step": 2, "x": 0.0}])
    labels = _labels(svg)
    assert labels[0] == "0" and "-0.5" not in labels
    zero_y = re.search(r'<text x="\d+" y="([\d.]+)" font-size="10" text-anchor="end">0</text>', svg)
    dots = re.findall(r'<circle cx="[\d.]+" cy="([\d.]+)"', svg)
    assert zero_y and dots and all(abs(float(d) - (float(zero_y.group(1)) - 3.5)) < 0.2 for d in dots)


def test_values_start_at_zero_and_axes_are_titled() -> None:
    chart = Chart("t", "t", "seconds", "count", (Line("x", "x"),))
    svg = line_chart(chart, [{"step": 1, "x": 100.0}, {"step": 2, "x": 101.0}])
    assert _labels(svg)[0] == "0"  # 100 -> 101 is not stretched over the whole height
    assert ">learner step</text>" in svg and ">seconds</text>" in svg
    assert svg.count('stroke="#e5e7eb"') >= 3  # gridlines


def test_every_chart_has_an_axis_title_and_a_meaning_for_no_data() -> None:
    for _, charts in SECTIONS:
        for chart in charts:
            assert chart.y_label and chart.empty, chart.id


def test_the_report_names_each_env_the_audit_retired_and_why() -> None:
    why = "the noop policy returned 1.00 on average over its 1 audit plays on rollout seeds (above 0.50)"
    context = ReportContext(audit_retired=[("env-forged", why)])
    page = render_report([{"step": 1, "pool/audit_retired": 1}], [], context)
    table = re.search(r'<table id="audit">(.*?)</table>', page, re.S)
    assert table is not None
    assert "<td>env-forged</td>" in table.group(1) and f"<td>{why}</td>" in table.group(1).replace("&gt;", ">")
    assert "Retired by the audit plays as trivially won (1)" in page
    none = render_report([], [], ReportContext())
    assert 'id="audit"' not in none and "No env was retired" in none


class _Texts(HTMLParser):
    """Each text of the page (character references resolved, i.e. unescaped once) with its element."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: set[str] = set()
        self.texts: list[tuple[str, str]] = []
        self._open: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.add(tag)
        self._open.append(tag)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.add(tag)

    def handle_endtag(self, tag: str) -> None:
        while tag in self._open and self._open.pop() != tag:
            pass

    def handle_data(self, data: str) -> None:
        if data.strip() and self._open:
            self.texts.append((self._open[-1], data))


HOSTILE = "<script>alert(1)</script> &amp; \"double\" 'single'"


def test_text_from_the_run_is_escaped_exactly_once() -> None:
    suite = "<b>&amp;"  # an eval suite's name reaches the page through a metric key
    records = [{"step": 1, f"designer/outcome/{HOSTILE}": 2, f"eval/{suite}/overall": 0.5}]
    context = ReportContext(
        summary=[HOSTILE], facts={HOSTILE: HOSTILE}, departures=[HOSTILE], audit_retired=[(HOSTILE, HOSTILE)]
    )
    columns = ("env_id", "skill", "status", "source", "failed_check")
    envs = [{**dict.fromkeys(columns, HOSTILE), "hint": HOSTILE, "code": HOSTILE}]
    page = render_report(records, envs, context)

    parser = _Texts()
    parser.feed(page)
    assert "script" not in parser.tags and "b" not in parser.tags  # escaped: no element came from the run
    # Unescaping the page once gives each text back as it was: not raw (the tags above), not escaped twice.
    texts = parser.texts
    assert texts.count(("li", HOSTILE)) == 2  # the summary and the departure
    assert texts.count(("th", HOSTILE)) == 1 and texts.count(("td", HOSTILE)) == 1 + 2 + len(columns)
    assert ("title", f"{HOSTILE}, step 1: 2") in texts and ("span", HOSTILE) in texts  # a bar and its legend
    assert ("title", f"{suite}: overall, step 1: 0.5") in texts and ("span", f"{suite}: overall") in texts
    assert "&amp;amp;amp;" not in page and "&amp;lt;" not in page


def test_the_page_is_self_contained() -> None:
    page = _render(RECORDS)
    assert page.startswith("<!doctype html>") and "<style>" in page
    assert not re.search(r"<script|<link|<img|src=|href=|url\(|@import", page)


def test_the_time_chart_stacks_the_phases_of_a_step_not_what_ran_inside_or_beside_them() -> None:
    (chart,) = (c for _, charts in SECTIONS for c in charts if c.id == "time")
    record = {
        "step": 1,
        "time/designer_s": 30.0,
        "time/rollout_s": 12.0,
        "time/learner_s": 3.0,
        # Inside or beside the phases: the learner during the next step, request-seconds that add up.
        "time/learner_overlapped_s": 40.0,
        "time/designer_generation_busy_s": 130.0,
        "time/rollout_generation_busy_s": 380.0,
    }
    plot = bar_plot(chart, [record])
    assert [(b.label, b.value) for b in plot.bars] == [("designer_s", 30.0), ("rollout_s", 12.0), ("learner_s", 3.0)]
    assert sum(b.value for b in plot.bars) == 45.0  # the step's wall time, as the console says
