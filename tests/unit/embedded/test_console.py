"""What ``spade run`` shows when its output is not a terminal (a log file, a pipe, CI)."""

from __future__ import annotations

import io

from rich.console import Console

from services.embedded.console import progress_bars


def test_off_a_terminal_each_phase_prints_plain_lines_at_its_start_and_every_tenth() -> None:
    out = io.StringIO()
    with progress_bars(Console(file=out, force_terminal=False, width=100)) as (_, progress):
        for step in range(49):
            progress("train", step, 48)
        progress("pairs", 0, 32)
        progress("designer", 0, 1)
        progress("designer", 1, 1)
    lines = out.getvalue().splitlines()
    train = [line for line in lines if line.startswith("train: ")]
    assert train[0].startswith("train: 0/48") and train[-1].startswith("train: 48/48")
    assert len(train) == 11  # 0/10 … 10/10: not one line per call
    assert any(line.startswith("pairs: 0/32") for line in lines)
    assert not any(line.startswith("designer: ") for line in lines)  # one unit each step: the step line says it


def test_on_a_terminal_only_the_bars_are_drawn() -> None:
    out = io.StringIO()
    with progress_bars(Console(file=out, force_terminal=True, width=100)) as (_, progress):
        for step in range(49):
            progress("train", step, 48)
    assert "train: " not in out.getvalue()
