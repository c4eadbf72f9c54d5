"""Command line of the designer: ``spade serve designer`` and ``spade designer build-corpus|show-prompt``.

Settings come from ``SPADE_DESIGNER_*`` environment variables; options given here override them.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import click

from spade.serving.run import config_option


def _offline_settings(**overrides: object) -> object:
    """Settings of the offline tools: they call no service, so the sandbox key is not needed."""
    from services.designer.settings import DesignerSettings
    from spade.serving.run import settings_or_exit

    return settings_or_exit(DesignerSettings, None, dev_mode=True, **overrides)


@click.command()
@config_option
@click.option("--setting", type=click.Choice(["game", "tool"]), default=None, help="Which kind of env to design.")
@click.option("--corpus", "corpus_path", type=click.Path(path_type=Path, exists=True), default=None)
@click.option("--dev", "dev_mode", is_flag=True, default=None, help="Allow unsafe defaults (local development).")
def serve(config_file: Path | None, setting: str | None, corpus_path: Path | None, dev_mode: bool | None) -> None:
    """The environment designer (distributed mode): designs a batch per k published weight versions."""
    from services.designer.settings import DesignerSettings
    from services.designer.wiring import designer_service
    from services.designer.worker import serve_forever
    from spade.serving.run import run_until_signalled, settings_or_exit

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    settings = settings_or_exit(
        DesignerSettings, config_file, setting=setting, corpus_path=corpus_path, dev_mode=dev_mode
    )
    from spade.dependencies import endpoint, inference, queue, wait_for

    wait_for(
        [
            queue(settings.queue),
            endpoint(settings.sandbox),
            endpoint(settings.memory),
            *inference(settings.inference_urls),
        ]
    )

    async def main(stop: asyncio.Event) -> None:
        async with designer_service(settings) as runtime:
            await serve_forever(runtime.designer, runtime.queue, regenerate_every=settings.regenerate_every, stop=stop)

    run_until_signalled(main)


@click.group()
def designer() -> None:
    """The environment designer's offline tools."""


@designer.command("build-corpus")
@click.option("--setting", type=click.Choice(["game", "tool", "all"]), default="all", show_default=True)
@click.option("--cache-dir", type=click.Path(path_type=Path), default=None, help="Default: ~/.cache/spade/corpus.")
def build_corpus_command(setting: str, cache_dir: Path | None) -> None:
    """Build the default offline corpus from installed packages' docstrings (no network)."""
    from services.designer.corpus.builder import build_corpus
    from services.designer.corpus.loader import load_jsonl

    for name in ["game", "tool"] if setting == "all" else [setting]:
        path = build_corpus(name, cache_dir)
        click.echo(f"{name}: {len(load_jsonl(path))} documents in {path}")


@designer.command("show-prompt")
@click.option("--setting", type=click.Choice(["game", "tool"]), default="game", show_default=True)
@click.option("--skill", default=None, help="Skill name (default: the first of the setting).")
@click.option("--corpus", "corpus_path", type=click.Path(path_type=Path, exists=True), default=None)
@click.option("--seed", type=int, default=0, show_default=True, help="Document sampling seed.")
@click.option("--as-json", is_flag=True, help="Print the chat messages as JSON.")
def show_prompt(setting: str, skill: str | None, corpus_path: Path | None, seed: int, as_json: bool) -> None:
    """Print one designer prompt, fitted to the token budget with the default model's tokenizer."""
    from services.designer.core.prompts import PromptParts, fit_prompt, truncate_words
    from services.designer.core.skills import skill_named, skills_for
    from services.designer.corpus.loader import CorpusSampler
    from services.designer.settings import DesignerSettings
    from services.designer.wiring import load_corpus, load_examples
    from spade.inference.chat import ChatFormatter
    from spade.inference.models import load_tokenizer, resolve_model_path

    settings = _offline_settings(setting=setting, corpus_path=corpus_path, corpus_seed=seed)
    assert isinstance(settings, DesignerSettings)
    chosen = skill_named(setting, skill) if skill else skills_for(setting)[0]
    document = CorpusSampler(load_corpus(settings), seed=seed).next_document()
    formatter = ChatFormatter(load_tokenizer(resolve_model_path(settings.tokenizer_path)))
    parts = PromptParts(
        setting=setting,
        skill=chosen,
        document=truncate_words(document.text, settings.doc_max_words),
        example=load_examples(setting)[0],
        excerpt_chars=settings.excerpt_chars,
    )
    fitted = fit_prompt(
        parts,
        formatter.apply,
        max_prompt_tokens=settings.max_prompt_tokens,
        doc_min_words=settings.doc_min_words,
    )
    if as_json:
        click.echo(json.dumps(fitted.messages, indent=2))
        return
    for message in fitted.messages:
        click.echo(f"--- {message['role']} ---\n{message['content']}\n")
    click.echo(f"--- {len(fitted.prompt_ids)} prompt tokens (budget {settings.max_prompt_tokens}) ---")


if __name__ == "__main__":
    designer()
