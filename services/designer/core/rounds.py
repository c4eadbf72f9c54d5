"""A regeneration round: its id, its result, and running its slots under a deadline and a stop signal.

Both designers (the policy's, ``core/loop.py``, and the pool's, ``core/pool.py``) fill a round's
slots concurrently. A round ends when every slot is done, when its deadline fires, or when the
service is asked to stop (SIGTERM). In the last two cases unfinished slots are cancelled, but any
answer that already exists is still validated, stored and published: finished work is kept (the
reference discarded every finished environment when its 900 s timeout fired). After a stop, that
finishing gets at most ``grace_s`` seconds, so shutdown is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections import Counter
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass

from services.designer.core.attempt import AttemptOutcome, AttemptRecord
from spade.serving.logs import get_logger

log = get_logger(__name__)


def new_round_id(round_index: int) -> str:
    """A round id: its index, readable, and a nonce so that two runs (or a restart) never share one.

    >>> new_round_id(3).startswith("r3-")
    True
    """
    if round_index < 0:
        raise ValueError(f"round_index must be >= 0, got {round_index}")
    return f"r{round_index}-{uuid.uuid4().hex[:12]}"


@dataclass(frozen=True)
class BatchResult:
    """What one regeneration round produced.

    Attributes:
        batch_id: The round id (carried by every designer sample of the round).
        round_index: The round's index (drives its skills).
        records: Every finished attempt, in completion order.
        timed_out: Whether the round's deadline cut it short.
        stopped: Whether a stop request (SIGTERM) cut it short.
        discarded: Attempts generated together with an earlier one of their slot and never finished,
            because that one filled the slot (``DesignerConfig.attempts_at_once``) or the round ended.
    """

    batch_id: str
    records: tuple[AttemptRecord, ...]
    timed_out: bool
    round_index: int = 0
    stopped: bool = False
    discarded: int = 0

    @property
    def env_ids(self) -> list[str]:
        """Ids of the new environments."""
        return [r.env_id for r in self.records if r.outcome is AttemptOutcome.VALID]

    @property
    def outcomes(self) -> Counter[str]:
        """Attempt count per outcome (``valid``, ``malformed``, ``duplicate``, each failing check, ...)."""
        return Counter(r.label for r in self.records)

    @property
    def validity_rate(self) -> float:
        """Valid attempts over attempts with output (0.0 when none)."""
        answered = [r for r in self.records if r.outcome.yields_sample]
        if not answered:
            return 0.0
        return sum(r.outcome is AttemptOutcome.VALID for r in answered) / len(answered)


@dataclass
class RoundState:
    """What the slots of one round share: finished records, the answers still being finished, and a
    count of generated attempts discarded unfinished."""

    records: list[AttemptRecord]
    finishing: set[asyncio.Task[AttemptRecord]]
    discarded: int = 0

    @classmethod
    def empty(cls) -> RoundState:
        return cls(records=[], finishing=set())

    async def finish(self, work: Awaitable[AttemptRecord]) -> AttemptRecord:
        """Run ``work`` (an answer's pipeline) so that cancelling the caller does not cancel it."""
        task = asyncio.ensure_future(work)
        self.finishing.add(task)
        return await asyncio.shield(task)


async def run_slots(
    batch_id: str,
    round_index: int,
    slots: Sequence[Awaitable[None]],
    state: RoundState,
    *,
    deadline_s: float,
    stop: asyncio.Event | None,
    grace_s: float,
) -> BatchResult:
    """Run the round's slot coroutines; see the module docstring for how it ends.

    Raises:
        Exception: The first exception a slot raised (a bug, e.g. a prompt that cannot fit), after
            the finished attempts were kept.
    """
    tasks = [asyncio.ensure_future(slot) for slot in slots]
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    pending = set(tasks)
    stopper = asyncio.ensure_future(stop.wait()) if stop is not None else None
    timed_out = stopped = False
    try:
        while pending:
            remaining = end - loop.time()
            if remaining <= 0:
                timed_out = True
                break
            waiting = pending | ({stopper} if stopper is not None else set())
            done, _ = await asyncio.wait(waiting, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            pending -= done
            if stopper is not None and stopper.done():
                stopped = bool(pending)
                break
    except asyncio.CancelledError:
        # The caller gave up on the round: stop the slots; answers already generated get the grace.
        await _cancel(tasks)
        await _drain(state, grace_s, batch_id)
        raise
    finally:
        if stopper is not None:
            stopper.cancel()
    if pending:
        why = "a stop request" if stopped else f"its {deadline_s:.0f} s deadline"
        log.warning(
            "designer round %s ended by %s: cancelling %d unfinished slots, keeping finished attempts",
            batch_id,
            why,
            len(pending),
        )
        await _cancel(list(pending))
    # Answers generated before the end are validated, stored and published regardless.
    await _drain(state, grace_s if stopped else None, batch_id)
    for task in tasks:
        if task.done() and not task.cancelled() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]
    result = BatchResult(
        batch_id=batch_id,
        records=tuple(state.records),
        timed_out=timed_out,
        round_index=round_index,
        stopped=stopped,
        discarded=state.discarded,
    )
    log.info("designer round %s (index %d): %s", batch_id, round_index, dict(result.outcomes))
    return result


async def _cancel(tasks: list[asyncio.Task[None]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _drain(state: RoundState, grace_s: float | None, batch_id: str) -> None:
    """Wait for answers still being finished (at most ``grace_s``), adding their records."""
    finishing = list(state.finishing)
    if not finishing:
        return
    done, late = await asyncio.wait(finishing, timeout=grace_s)
    if late:
        log.error(
            "designer round %s: %d answers were still being validated/stored %.0f s after the stop; "
            "abandoning them (their attempts are lost)",
            batch_id,
            len(late),
            grace_s or 0.0,
        )
        for task in late:
            task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*late, return_exceptions=True)
    seen = {r.sample_id for r in state.records}
    for task in done:
        if task.cancelled():
            continue
        error = task.exception()
        if error is not None:
            log.error("finishing a designer attempt failed: %s", error)
            continue
        record = task.result()
        if record.sample_id not in seen:
            state.records.append(record)
            seen.add(record.sample_id)
