"""The pool designer: designer answers taken from a fixed pool instead of the policy.

Each answer is the exact text a designer model writes (one ```` ```python ```` block, then
``### HINT``, then the hint) and goes through the same pipeline as the policy's (parse, repair,
validate, store, announce; ``core/pipeline.py``), so its env is played in both arms and its sample
is scored like any other. It is the paper's fixed-env designer baseline and the way to exercise the
regret path with the real agent model when the policy cannot yet write valid envs. Its samples carry
``trainable=False``: scored, never trained on (the pool's text has no policy tokens or logprobs).

Rounds are as the policy designer's: round ``r`` takes the next ``envs_per_round`` answers, and its
slots get the round's skills round-robin (``core/skills.py``) unless an answer names its own skill.
Each answer is used once; when the pool is spent, a round is empty and :attr:`DesignerPool.exhausted`
says so.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from services.designer.core.attempt import AttemptOutcome, AttemptRecord
from services.designer.core.pipeline import AttemptPipeline
from services.designer.core.rounds import BatchResult, RoundState, new_round_id, run_slots
from services.designer.core.skills import assign_round, skill_named
from spade.envs.types import Setting
from spade.serving.logs import get_logger

log = get_logger(__name__)


@dataclass(frozen=True)
class PoolAnswer:
    """One answer of the pool.

    Attributes:
        name: Where it came from (its file name), recorded with the env as its source.
        text: The answer, exactly as a designer model would write it.
        skill: The skill it names for itself, ``None`` to take its slot's.
    """

    name: str
    text: str
    skill: str | None = None


@dataclass(frozen=True)
class PoolConfig:
    """The pool designer's knobs.

    Attributes:
        setting: ``"game"`` or ``"tool"``.
        envs_per_round: Answers per round (run spec).
        skills_per_round: Skills per round (run spec).
        concurrency: Answers validated at once.
        batch_timeout_s: Deadline of a round.
        grace_s: After a stop request, how long answers being finished may take.
        spec_id: The run spec's id.
    """

    setting: str = Setting.GAME
    envs_per_round: int = 6
    skills_per_round: int = 3
    concurrency: int = 2
    batch_timeout_s: float = 900.0
    grace_s: float = 20.0
    spec_id: str = ""


class DesignerPool:
    """Designs rounds from a pool of answers (see the module docstring).

    Args:
        config: The pool designer's knobs.
        answers: The pool, in the order it is used.
        pipeline: The answer pipeline (the same as the policy designer's).

    Raises:
        ValueError: An answer names a skill that is not one of the setting's six.
    """

    def __init__(self, config: PoolConfig, answers: Sequence[PoolAnswer], *, pipeline: AttemptPipeline) -> None:
        for answer in answers:
            if answer.skill is not None:
                try:
                    skill_named(config.setting, answer.skill)
                except ValueError as error:
                    raise ValueError(f"pool answer {answer.name}: {error}") from None
        self.config = config
        self._answers = tuple(answers)
        self._pipeline = pipeline
        self._used = 0
        self._next_round = 0

    @property
    def exhausted(self) -> bool:
        """Whether every answer of the pool has been used."""
        return self._used >= len(self._answers)

    @property
    def remaining(self) -> int:
        """Answers not used yet."""
        return len(self._answers) - self._used

    async def run_batch(
        self, *, round_index: int | None = None, stop: asyncio.Event | None = None, weight_version: int = 0
    ) -> BatchResult:
        """Send the round's answers through the pipeline.

        Args:
            round_index: The round (drives the skills of its slots); defaults to the one after the last.
            stop: Set to end the round early (SIGTERM); answers being finished get ``grace_s``.
            weight_version: The policy version current when the round runs (recorded with the env;
                the rollout fixes its window when it first plays it).
        """
        config = self.config
        index = self._next_round if round_index is None else round_index
        self._next_round = index + 1
        batch_id = new_round_id(index)
        taken = self._answers[self._used : self._used + config.envs_per_round]
        self._used += len(taken)
        if not taken:
            log.warning("designer pool: every answer has been used; round %d is empty", index)
        skills = assign_round(
            config.setting, index, envs_per_round=config.envs_per_round, skills_per_round=config.skills_per_round
        )[: len(taken)]
        state = RoundState.empty()
        gate = asyncio.Semaphore(config.concurrency)

        async def slot_task(slot: int, answer: PoolAnswer, skill: str) -> None:
            record = AttemptRecord(
                sample_id=uuid.uuid4().hex,
                batch_id=batch_id,
                slot=slot,
                attempt=0,
                setting=config.setting,
                skill=skill,
                outcome=AttemptOutcome.GENERATION_FAILED,
                weight_version=weight_version,
                finish_reason="stop",
                text=answer.text,
                source={"name": answer.name, "pool_file": answer.name},
                round_index=index,
                spec_id=config.spec_id,
                trainable=False,
            )
            async with gate:
                state.records.append(await state.finish(self._pipeline.finish(record)))

        slots = [
            slot_task(slot, answer, skill_named(config.setting, answer.skill).name if answer.skill else skill.name)
            for slot, (answer, skill) in enumerate(zip(taken, skills, strict=True))
        ]
        return await run_slots(
            batch_id, index, slots, state, deadline_s=config.batch_timeout_s, stop=stop, grace_s=config.grace_s
        )
