"""``spade serve inference``: the embedded SGLang-compatible server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click


@click.command()
@click.option(
    "--model",
    "model_path",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="Local Hugging Face checkpoint directory (default: SmolLM2-135M-Instruct, converted once).",
)
@click.option("--host", default=None, help="Interface to listen on (default 127.0.0.1).")
@click.option("--port", type=int, default=None, help="TCP port (default 30000).")
@click.option("--weight-version", default=None, help="Weight version reported before any update.")
def serve(model_path: Path | None, host: str | None, port: int | None, weight_version: str | None) -> None:
    """Serve SGLang's /generate, /v1/chat/completions, /update_weights_from_disk, ... on CPU."""
    import uvicorn

    from services.inference.settings import InferenceSettings
    from services.inference.wiring import build_app
    from spade.inference.models import ModelError

    overrides: dict[str, Any] = {"model_path": model_path, "host": host, "port": port, "weight_version": weight_version}
    settings = InferenceSettings(**{k: v for k, v in overrides.items() if v is not None})
    try:
        settings.check_safe()
        app = build_app(settings)
    except (ValueError, ModelError) as exc:
        raise click.ClickException(str(exc)) from exc
    uvicorn.run(app, host=settings.host, port=settings.port, log_level="info")
