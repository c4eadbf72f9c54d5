"""``spade serve inference``: the embedded SGLang-compatible server."""

from __future__ import annotations

from pathlib import Path
from typing import Any, get_args

import click

from services.inference.settings import WeightsMode
from spade.serving.run import config_option, configure_logs, log_level_option


@click.command()
@config_option
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
@click.option(
    "--enable-deterministic-inference",
    "deterministic",
    is_flag=True,
    default=None,
    help="Batch-invariant mode for every request (SGLang's flag of the same name).",
)
@click.option(
    "--weights",
    type=click.Choice(get_args(WeightsMode)),
    default=None,
    help="float32 (default): serve the checkpoint's weights, logprobs exact to a float32 learner's; bf16: serve "
    "the weights rounded to bf16 (bf16 activations in decode steps, and in prefills where the CPU has native "
    "bf16); int8: decode from int8 weights, faster on CPU, logprobs corrected by the learner's TIS; int4: 4-bit "
    "layers, int8 LM head (docs/inference.md).",
)
@click.option("--dev", "dev_mode", is_flag=True, default=None, help="Dev mode: allow an exposed host.")
@log_level_option
def serve(
    config_file: Path | None,
    model_path: Path | None,
    host: str | None,
    port: int | None,
    weight_version: str | None,
    deterministic: bool | None,
    weights: str | None,
    dev_mode: bool | None,
    log_level: str | None,
) -> None:
    """Serve SGLang's /generate, /v1/chat/completions, /update_weights_from_disk, ... on CPU, until SIGTERM/SIGINT."""
    configure_logs("inference", log_level)
    from services.inference.quant import QuantizationUnavailable
    from services.inference.settings import InferenceSettings
    from services.inference.wiring import serve_forever
    from spade.inference.models import ModelError
    from spade.serving.run import run_until_signalled, settings_or_exit

    bind: dict[str, Any] = {k: v for k, v in {"host": host, "port": port}.items() if v is not None}
    settings = settings_or_exit(
        InferenceSettings,
        config_file,
        model_path=model_path,
        http=bind or None,
        weight_version=weight_version,
        enable_deterministic_inference=deterministic,
        weights=weights,
        dev_mode=dev_mode,
    )
    try:
        run_until_signalled(lambda stop: serve_forever(settings, stop))
    except (ModelError, OSError, QuantizationUnavailable) as exc:
        raise click.ClickException(str(exc)) from exc
