"""report.html in a real browser: headless Chromium renders it, the summary and every chart are there.

Needs Debian's chromium (scripts/setup.sh installs it); skipped with the reason where it is missing.
"""

from __future__ import annotations

import shutil
import struct
import subprocess
import zlib
from html.parser import HTMLParser
from pathlib import Path

import pytest

from services.embedded.metrics import summary_sentences
from services.embedded.report import ReportContext, chart_ids, write_report

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (scripts/setup.sh installs it)"),
]

# The flags the machine notes give for a root, offline, headless Chromium.
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)

RECORDS = [
    {
        "step": 1,
        "designer/ran": True,
        "designer/attempts": 4,
        "designer/valid": 0,
        "designer/outcome/malformed": 4,
        "designer/validity_rate": 0.0,
        "agent/plays": 20,
        "agent/win_rate": 0.31,
        "agent/solved_fraction": 0.25,
        "agent/hinted_win_rate": 0.45,
        "agent/finish/terminated": 18,
        "agent/finish/turn_limit": 2,
        "play/regret_mean": 0.14,
        "play/plateau_mean": 0.4,
        "play/learnable_fraction": 0.5,
        "learner/loss": 0.0,
        "learner/trained": True,
        "pool/envs": 5,
        "pool/vendi_per_n": 0.8,
        "pool/learnable_fraction": 0.4,
        "time/designer_s": 31.0,
        "time/rollout_s": 14.0,
        "time/learner_s": 9.0,
    },
    {
        "step": 2,
        "designer/ran": True,
        "designer/attempts": 4,
        "designer/valid": 1,
        "designer/outcome/valid": 1,
        "designer/outcome/malformed": 2,
        "designer/outcome/smoke": 1,
        "designer/validity_rate": 0.25,
        "agent/plays": 24,
        "agent/win_rate": 0.35,
        "agent/solved_fraction": 0.29,
        "designer/scored": 4,
        "designer/blend_mean": 0.2,
        "designer/advantage_nonzero_frac": 0.5,
        "learner/loss": 0.0,
        "learner/trained": True,
        "pool/envs": 6,
        "eval/pool/overall": 0.3,
        "eval/pool/overall_low": 0.1,
        "eval/pool/overall_high": 0.5,
        "time/designer_s": 29.0,
        "time/rollout_s": 15.0,
        "time/learner_s": 8.0,
    },
]


class _Dom(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.charts: dict[str, int] = {}
        self._open: str | None = None
        self.summary_items = 0
        self._in_summary = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if tag == "figure" and found.get("data-chart"):
            self._open = str(found["data-chart"])
            self.charts[self._open] = 0
        elif tag == "svg" and self._open is not None:
            self.charts[self._open] += 1
        elif tag == "ul" and found.get("id") == "summary":
            self._in_summary = True
        elif tag == "li" and self._in_summary:
            self.summary_items += 1

    def handle_endtag(self, tag: str) -> None:
        if tag == "figure":
            self._open = None
        elif tag == "ul":
            self._in_summary = False


def _png_pixels(path: Path) -> tuple[int, int, bytes]:
    """Width, height and the decompressed scanlines of a PNG (enough to tell a blank page)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, width, height, idat = 8, 0, 0, b""
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos : pos + 8])
        chunk = data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            width, height = struct.unpack(">II", chunk[:8])
        elif kind == b"IDAT":
            idat += chunk
        pos += 12 + length
    return width, height, zlib.decompress(idat)


def _chromium(*args: str, user_dir: Path) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    return subprocess.run(
        [CHROMIUM, *FLAGS, f"--user-data-dir={user_dir}", *args],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


def test_chromium_renders_the_report_with_its_summary_and_every_chart(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(__import__("json").dumps(r) + "\n" for r in RECORDS))
    summary = summary_sentences(RECORDS, designer_mode="policy", pool_designer=False, seeded=5, static=0)
    context = ReportContext(summary=summary, facts={"run spec id": "0123abcd"}, departures=["lr = 1e-05 (...)"])
    page = write_report(run_dir, [{"env_id": "e1", "skill": "Optimization", "status": "valid"}], context)

    dumped = _chromium("--dump-dom", page.as_uri(), user_dir=tmp_path / "profile-dom")
    assert dumped.returncode == 0, dumped.stderr[-2000:]
    dom = _Dom()
    dom.feed(dumped.stdout)
    assert list(dom.charts) == chart_ids(), "a chart is missing from the rendered page"
    assert all(n == 1 for n in dom.charts.values()), dom.charts
    assert dom.summary_items == len(summary) >= 3
    assert "The designer wrote 1 valid environment(s) in 8 attempts" in dumped.stdout

    shot = tmp_path / "report.png"
    done = _chromium(f"--screenshot={shot}", "--window-size=1400,3000", page.as_uri(), user_dir=tmp_path / "profile")
    assert done.returncode == 0 and shot.exists(), done.stderr[-2000:]
    width, height, pixels = _png_pixels(shot)
    assert (width, height) == (1400, 3000)
    assert len(set(pixels)) > 32, "the screenshot is blank"
    assert pixels.count(255) < 0.995 * len(pixels), "the screenshot is (almost) all white"
