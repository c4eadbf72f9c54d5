"""The ``spade`` command line: one entry point, a subcommand per service.

Subcommands are imported lazily, so ``spade sandbox exec`` does not pay for torch, and a service's
command lives next to its service (``services/<name>/cli.py``), not here.
"""

from __future__ import annotations

import importlib
from typing import Any

import click


class LazyGroup(click.Group):
    """A click group whose subcommands are ``"module:attribute"`` paths imported on first use."""

    def __init__(self, *args: Any, lazy: dict[str, tuple[str, str]] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lazy = dict(lazy or {})

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # Help lists the static one-liners: listing must not import every service (and torch).
        rows = [(name, self._lazy[name][1]) for name in sorted(self._lazy)]
        rows += [(name, cmd.get_short_help_str()) for name, cmd in sorted(self.commands.items())]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self._lazy})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self._lazy:
            path = self._lazy[cmd_name][0]
            module_name, attr = path.split(":")
            command = getattr(importlib.import_module(module_name), attr)
            if not isinstance(command, click.Command):
                raise TypeError(f"{path} is not a click command")
            return command
        return super().get_command(ctx, cmd_name)


@click.group(
    cls=LazyGroup,
    lazy={
        "serve": ("spade.cli:serve", "Start one service (distributed mode)."),
        "sandbox": ("services.sandbox.cli:sandbox", "Run or validate code in the sandbox."),
        "envs": ("services.memory.cli:envs", "Inspect the environment memory."),
        "runspec": ("services.memory.cli:runspec", "Store or show the run spec every service reads."),
        "designer": ("services.designer.cli:designer", "Designer tools: build-corpus, show-prompt, example-pool."),
        "run": ("services.embedded.cli:run", "Run the whole self-play loop in one process."),
        "migrate": ("services.cluster.migrate:migrate_command", "Create or upgrade the database schema, once."),
        "eval": ("services.eval.cli:eval_group", "Score a checkpoint or server on held-out suites; compare two runs."),
        "cluster": ("services.cluster.cli:cluster", "Run every service as a process of this machine (up/down/status)."),
        "warmstart": (
            "services.embedded.warmstart.cli:warmstart",
            "Fine-tune the designer role on validated family answers (cached).",
        ),
    },
)
@click.version_option(package_name="spade")
def main() -> None:
    """SPADE: one policy designs executable environments and learns to solve them."""


@click.group(
    cls=LazyGroup,
    lazy={
        "sandbox": ("services.sandbox.cli:serve", "The sandbox service (gRPC + REST)."),
        "memory": ("services.memory.cli:serve", "The environment memory service (gRPC + REST)."),
        "inference": ("services.inference.cli:serve", "The embedded SGLang-compatible server."),
        "learner": ("services.learner.cli:serve", "The learner (GRPO, checkpoints, weights)."),
        "designer": ("services.designer.cli:serve", "The environment designer."),
        "rollout": ("services.rollout.cli:serve", "The rollout workers (the reasoning agent)."),
    },
)
@click.pass_context
def serve(ctx: click.Context) -> None:
    """Start one service (distributed mode).

    Logs are JSON lines on stderr (``SPADE_LOG_FORMAT=text`` for a terminal; ``SPADE_LOG_LEVEL``).
    """
    from spade.serving.logs import configure_from_env

    try:
        configure_from_env(ctx.invoked_subcommand or "spade")
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None


if __name__ == "__main__":
    main()
