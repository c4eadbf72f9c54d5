"""The ``pool`` suite: held-out seeds of the run's own environments, the in-distribution check.

Each item is one unhinted play of one env of the pool (``services/eval/pool_source.py``) on a seed
that training did not use (``held_out_seeds``), played exactly as the rollout plays: the rollout's
episode loop (``spade.agent.episode.EpisodeRunner``) with its prompts, through a real
sandbox session. Every model turn is seeded (``turn_seeds``: the suite's seed, the env, the play seed
and the turn), so with the server's batch-invariant mode the same weights give the same replies in
every run, at any concurrency. The score is the env's return. A sandbox fault (the sandbox, not the env, failed)
is retried under the suite's retry policy and then stops the eval, which can be resumed; it is
never scored.

Items are listed seed index by seed index over the envs, so a ``--limit`` prefix plays many envs
once before any env twice; the category is the env's skill.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from services.eval.core.records import ItemResult, prompt_hash
from services.eval.core.runner import EvalItem
from services.eval.pool_source import PoolEnv, held_out_seeds
from spade.agent.episode import EpisodeRunner, Play, TurnSeeds
from spade.agent.ports import ChatTemplate, EnvSpec
from spade.inference.seeds import derive_sampling_seed
from spade.retry import RetryPolicy
from spade.sandbox.errors import SandboxFault
from spade.serving.logs import get_logger

log = get_logger(__name__)

NAME = "pool"


def replies(play: Play, template: ChatTemplate) -> tuple[str, ...]:
    """The model's replies in a play: each run of sampled (loss-masked) tokens, decoded."""
    out: list[str] = []
    run: list[int] = []
    for token, sampled in zip(play.trajectory.token_ids, play.trajectory.loss_mask, strict=True):
        if sampled:
            run.append(token)
        elif run:
            out.append(template.decode_reply(run))
            run = []
    if run:
        out.append(template.decode_reply(run))
    return tuple(out)


def prompt_ids(play: Play) -> list[int]:
    """The tokens the model saw before its first reply."""
    mask = play.trajectory.loss_mask
    first = mask.index(True) if True in mask else len(mask)
    return list(play.trajectory.token_ids[:first])


class PoolSuite:
    """Held-out plays of a pool's environments.

    Args:
        runner: The rollout's episode loop, wired to a sandbox and the model (None: list only).
        template: The model's chat template (to decode replies).
        envs: The playable envs (see ``pool_source.playable``).
        seed: Seed of the held-out seeds.
        seeds_per_env: Held-out plays per env.
        source: What the envs were read from (for messages; the envs' code hashes identify the pool).
        retry: How often a play hit by a sandbox fault is tried again.
    """

    name = NAME

    def __init__(
        self,
        runner: EpisodeRunner | None,
        template: ChatTemplate | None,
        envs: Sequence[PoolEnv],
        seed: int,
        seeds_per_env: int = 4,
        source: str = "",
        retry: RetryPolicy | None = None,
    ) -> None:
        if not envs:
            raise ValueError(f"the pool at {source or '(given)'} has no env that passed validation; nothing to play")
        if seeds_per_env < 1:
            raise ValueError(f"seeds_per_env must be >= 1, got {seeds_per_env}")
        self.runner = runner
        self.template = template
        self.envs = {env.env_id: env for env in envs}
        self.seed = seed
        self.seeds_per_env = seeds_per_env
        self.source = source
        self.retry = retry or RetryPolicy(attempts=3)
        seeds = {env.env_id: held_out_seeds(env.env_id, seed, seeds_per_env, env.played_seeds) for env in envs}
        self._items = [
            EvalItem(f"{env.env_id}/{seeds[env.env_id][k]}", env.skill, (env.env_id, seeds[env.env_id][k]))
            for k in range(seeds_per_env)
            for env in envs
        ]

    def config(self) -> dict[str, Any]:
        """The envs (by code hash), seeds per env and the play limits."""
        limits = self.runner.limits if self.runner is not None else None
        return {
            "envs": {env_id: env.code_hash for env_id, env in self.envs.items()},
            "seeds_per_env": self.seeds_per_env,
            "limits": None
            if limits is None
            else {
                "max_turns": limits.max_turns,
                "max_tokens_per_turn": limits.max_tokens_per_turn,
                "max_total_tokens": limits.max_total_tokens,
            },
        }

    def turn_seeds(self, env_id: str, seed: int) -> TurnSeeds:
        """The ``sampling_seed`` of each turn of one held-out play: (suite and its seed, env, play seed, turn).

        The same for every run of the suite with the same seed, whatever the label, the order or the
        concurrency of the plays; never one of the rollout's (theirs are keyed by the run's id).
        """
        run = f"eval:{NAME}:{self.seed}"
        return lambda turn: derive_sampling_seed(run, env_id, "eval", seed, "unhinted", turn)

    def items(self) -> list[EvalItem]:
        """Every (env, held-out seed), seed index by seed index."""
        return list(self._items)

    async def run(self, item: EvalItem) -> ItemResult:
        """Play the env unhinted on the held-out seed; the score is its return."""
        if self.runner is None or self.template is None:
            raise RuntimeError("this PoolSuite was built without an episode runner; it can only list items")
        env_id, seed = item.payload
        env = self.envs[env_id]
        spec = EnvSpec(env_id=env.env_id, setting=env.setting, skill=env.skill, code=env.code, hint=env.hint)
        runner = self.runner
        async for attempt in self.retry.async_retrying(SandboxFault, logger=log, what=f"play of {item.id}"):
            with attempt:
                play = await runner.play(spec, seed, hinted=False, turn_seeds=self.turn_seeds(env.env_id, seed))
        detail = {
            "seed": seed,
            "turns": play.turns,
            "finish_reason": str(getattr(play.finish_reason, "value", play.finish_reason)),
            "setting": env.setting,
        }
        return ItemResult(
            item.id,
            item.category,
            prompt_hash(prompt_ids(play)),
            replies(play, self.template),
            float(play.episode_return),
            "",
            detail,
        )
