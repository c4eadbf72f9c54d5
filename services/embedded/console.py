"""What ``spade run`` and ``spade warmstart`` show a person: our own progress bars, not the libraries'."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from spade.serving.logs import configure_from_env

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress

Progress_ = Callable[[str, float, float], None]
"""``progress(phase, done, total)``: a bar per phase, created on its first call."""


def configure_output(command: str, verbose: bool) -> None:
    """Log every service's progress with ``verbose``; otherwise warnings only, and no library bars.

    The lines are the services' own (``spade.serving.logs``): text on a terminal unless
    ``SPADE_LOG_FORMAT`` says ``json``. Our own bars say what is happening; the libraries' per-load
    bars would interleave with them.
    """
    configure_from_env(command, level=logging.INFO if verbose else logging.WARNING, default_format="text")
    if verbose:
        return
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


@contextlib.contextmanager
def progress_bars(console: Console) -> Iterator[tuple[Progress, Progress_]]:
    """Bars on ``console``: yields the rich ``Progress`` (to print above the bars) and the callback.

    On a console that is not a terminal (a log file, a pipe, CI), rich draws the bars only once, when
    they close; so there each phase of more than one unit also prints a plain line when it starts and
    at every tenth of its total (the steps, the warm start's pairs and SFT steps), so that a
    20-minute warm start is not 20 minutes of silence.
    """
    from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description:<10}"), BarColumn(), TextColumn("{task.completed:g}/{task.total:g}"))
    with Progress(*columns, TimeElapsedColumn(), console=console) as bars:
        tasks: dict[str, TaskID] = {}
        tenths: dict[str, int] = {}
        started: dict[str, float] = {}

        def progress(phase: str, done: float, total: float) -> None:
            if phase not in tasks:
                tasks[phase] = bars.add_task(phase, total=total)
                started[phase] = time.monotonic()
            bars.update(tasks[phase], completed=done, total=total)
            if (
                console.is_terminal or total <= 1
            ):  # a one-unit phase (a step's designer, rollout, learner) says nothing new
                return
            tenth = min(10, int(10 * done / total)) if total > 0 else 10
            if tenths.get(phase) != tenth:
                tenths[phase] = tenth
                elapsed = int(time.monotonic() - started[phase])
                bars.console.print(f"{phase}: {done:g}/{total:g} ({elapsed // 60}:{elapsed % 60:02d})", highlight=False)

        yield bars, progress
