"""The designer warm start (DESIGN §5, "Small models: families, warm start, no idle steps").

Supervised fine-tuning of the designer role on validated (real designer prompt -> family answer)
pairs, cached like the converted model, so a small policy starts the run writing valid
environments some of the time. A departure from the paper, whose Qwen3 models write valid
environments from the prompt alone. See docs/warmstart.md.

The embedded run calls ``await warm_start(WarmStartSettings.from_run(run_settings), progress=...)``
(``ensure_warm_start`` outside an event loop) and uses the returned directory as its ``model_path``.
Importing this package is light: torch and the sandbox are imported when a warm start is built.

Modules: ``settings`` (the knobs), ``data`` (the pairs), ``train`` (the SFT loop), ``evaluate``
(validity on held-out prompts), ``build`` (one warm start end to end), ``cache`` (the cached
checkpoint), ``cli`` (``spade warmstart``).
"""

from __future__ import annotations

from services.embedded.warmstart.cache import ensure_warm_start, read_record, warm_start, warm_start_dir
from services.embedded.warmstart.settings import WarmStartSettings

__all__ = ["WarmStartSettings", "ensure_warm_start", "read_record", "warm_start", "warm_start_dir"]
