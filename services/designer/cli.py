"""Command line of the designer: ``spade serve designer`` and ``spade designer build-corpus|show-prompt``.

Settings come from ``SPADE_DESIGNER_*`` environment variables; options given here override them.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import click

from spade.envs.types import SETTINGS, Setting
from spade.serving.run import config_option, configure_logs, log_level_option


def _offline_settings(**overrides: object) -> object:
    """Settings of the offline tools: they call no service, so the sandbox key is not needed."""
    from services.designer.settings import DesignerSettings
    from spade.serving.run import settings_or_exit

    return settings_or_exit(DesignerSettings, None, dev_mode=True, **overrides)


@click.command()
@config_option
@click.option("--setting", type=click.Choice(SETTINGS), default=None, help="Which kind of env to design.")
@click.option("--corpus", "corpus_path", type=click.Path(path_type=Path, exists=True), default=None)
@click.option(
    "--pool",
    "pool_dir",
    type=click.Path(path_type=Path, exists=True, file_okay=False),
    default=None,
    help="Design from this directory of designer answers (the pool designer: scored, never trained).",
)
@click.option(
    "--spec",
    "spec_file",
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    default=None,
    help="Run spec file: stored in the memory when none is (else it must equal the stored one).",
)
@click.option("--dev", "dev_mode", is_flag=True, default=None, help="Allow unsafe defaults (local development).")
@log_level_option
def serve(
    config_file: Path | None,
    setting: str | None,
    corpus_path: Path | None,
    pool_dir: Path | None,
    spec_file: Path | None,
    dev_mode: bool | None,
    log_level: str | None,
) -> None:
    """The environment designer (distributed mode): designs a round per k published weight versions."""
    configure_logs("designer", log_level)
    from services.designer.settings import DesignerSettings, SpecMismatch
    from services.designer.wiring import designer_service
    from services.designer.worker import serve_forever
    from spade.config import ConfigError
    from spade.inference.client import InferenceUnavailable
    from spade.memory.errors import MemoryServiceError
    from spade.serving import lifecycle
    from spade.serving.run import run_until_signalled, settings_or_exit
    from spade.serving.startup import StoppedWhileWaiting

    settings = settings_or_exit(
        DesignerSettings,
        config_file,
        setting=setting,
        corpus_path=corpus_path,
        pool_dir=pool_dir,
        spec_file=spec_file,
        dev_mode=dev_mode,
    )
    from spade.dependencies import DependencyUnavailable, endpoint, inference, queue, wait_for

    needs_inference = settings.pool_dir is None or (
        settings.setting == Setting.TOOL and settings.criteria_reachable.enabled
    )
    try:
        wait_for(
            [
                queue(settings.queue),
                endpoint(settings.sandbox),
                endpoint(settings.memory),
                *(inference(settings.inference_urls) if needs_inference else []),
            ]
        )
    except DependencyUnavailable as error:
        click.echo(f"designer: gave up waiting for a dependency: {error}", err=True)
        raise SystemExit(1) from None

    async def main(stop: asyncio.Event) -> None:
        async with designer_service(settings, stop=stop) as runtime:
            source = f"the pool {settings.pool_dir}" if settings.pool_dir is not None else "the model"
            lifecycle.started(
                f"designer serving: {settings.setting} envs from {source}, a round at weight version "
                f"{runtime.initial_version} and then every {settings.regenerate_every} published versions "
                f"(spec {runtime.spec.spec_id})",
                settings=settings,
                setting=settings.setting,
                spec_id=runtime.spec.spec_id,
                version=runtime.initial_version,
            )
            await serve_forever(
                runtime.designer,
                runtime.queue,
                regenerate_every=settings.regenerate_every,
                stop=stop,
                initial_version=runtime.initial_version,
            )

    try:
        run_until_signalled(main)
    except StoppedWhileWaiting as stopped:
        click.echo(f"designer: {stopped}", err=True)
    except SpecMismatch as mismatch:
        click.echo("the designer's settings contradict the run spec:", err=True)
        for problem in mismatch.problems:
            click.echo(f"  {problem}", err=True)
        raise SystemExit(2) from None
    except (ConfigError, MemoryServiceError, InferenceUnavailable) as error:
        # A spec file that is invalid or differs from the stored spec (RunSpecConflict) is
        # configuration (status 2); an unreachable memory or inference server is not (status 1).
        click.echo(f"designer: {error}", err=True)
        configuration = isinstance(error, ConfigError) or getattr(error, "code", "") == "runspec_conflict"
        raise SystemExit(2 if configuration else 1) from None


@click.group()
def designer() -> None:
    """The environment designer's offline tools."""


@designer.command("build-corpus")
@click.option("--setting", type=click.Choice([*SETTINGS, "all"]), default="all", show_default=True)
@click.option("--cache-dir", type=click.Path(path_type=Path), default=None, help="Default: ~/.cache/spade/corpus.")
def build_corpus_command(setting: str, cache_dir: Path | None) -> None:
    """Build the default offline corpus from installed packages' docstrings (no network)."""
    from services.designer.corpus.builder import build_corpus
    from services.designer.corpus.loader import load_jsonl

    for name in list(Setting) if setting == "all" else [setting]:
        path = build_corpus(name, cache_dir)
        click.echo(f"{name}: {len(load_jsonl(path))} documents in {path}")


@designer.command("example-pool")
@click.argument("directory", type=click.Path(path_type=Path, file_okay=False))
@click.option("--setting", type=click.Choice(SETTINGS), default=Setting.GAME.value, show_default=True)
def example_pool(directory: Path, setting: str) -> None:
    """Write the contract's example envs as designer answers: a pool for `--pool DIR` / `--designer-pool DIR`."""
    from services.designer.pool_files import write_example_pool

    for path in write_example_pool(directory, setting):
        click.echo(str(path))


@designer.command("show-prompt")
@click.option("--setting", type=click.Choice(SETTINGS), default=Setting.GAME.value, show_default=True)
@click.option("--skill", default=None, help="Skill name (default: the first of the setting).")
@click.option("--corpus", "corpus_path", type=click.Path(path_type=Path, exists=True), default=None)
@click.option("--seed", type=int, default=0, show_default=True, help="Document sampling seed.")
@click.option(
    "--spec",
    "spec_file",
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    default=None,
    help="Run spec file for the agent's budget (default: the paper's values).",
)
@click.option("--as-json", is_flag=True, help="Print the chat messages as JSON.")
def show_prompt(
    setting: str, skill: str | None, corpus_path: Path | None, seed: int, spec_file: Path | None, as_json: bool
) -> None:
    """Print one designer prompt, fitted to the token budget with the default model's tokenizer."""
    from services.designer.core.prompts import AgentBudget, PromptParts, fit_prompt, truncate_words
    from services.designer.core.skills import skill_named, skills_for
    from services.designer.corpus.loader import CorpusSampler
    from services.designer.settings import DesignerSettings
    from services.designer.wiring import load_corpus, load_examples
    from spade.inference.chat import ChatFormatter
    from spade.inference.models import load_tokenizer, resolve_model_path
    from spade.memory.runspec import load_spec_file
    from spade.runspec import RunSpec

    settings = _offline_settings(setting=setting, corpus_path=corpus_path, corpus_seed=seed)
    assert isinstance(settings, DesignerSettings)
    spec = load_spec_file(spec_file) if spec_file else RunSpec()
    chosen = skill_named(setting, skill) if skill else skills_for(setting)[0]
    document = CorpusSampler(load_corpus(settings), seed=seed).next_document()
    formatter = ChatFormatter(load_tokenizer(resolve_model_path(settings.tokenizer_path)))
    parts = PromptParts(
        setting=setting,
        skill=chosen,
        document=truncate_words(document.text, settings.doc_max_words),
        example=load_examples(setting)[0],
        excerpt_chars=settings.excerpt_chars,
        budget=AgentBudget(max_turns=spec.agent_max_turns, max_tokens_per_turn=spec.agent_max_tokens_per_turn),
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
