"""Weight publishing: tell every inference worker to load version N, then announce it.

The weights are already on disk (``checkpoint.write_weights``); this module calls each worker's
SGLang ``/update_weights_from_disk`` with ``weight_version=str(N)`` through the shared inference
client, retries the workers that failed (in rounds, under a ``spade.retry.RetryPolicy``), and
publishes ``WeightsPublished`` on ``weights.published`` listing who acknowledged and who did not. A
partial update is never silent: it is logged as an error, the failing workers are marked unhealthy
(and retried at the next publish), the announcement names them, and with ``require_all=True`` it
raises.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from services.learner.latest import check_unpublished, point_latest
from spade.endpoints import InferenceEndpoint
from spade.inference.client import InferenceClient, WeightUpdateResult
from spade.queues.base import WEIGHTS_PUBLISHED, WorkQueue
from spade.retry import RetryPolicy
from spade.serving.logs import get_logger
from spade.v1 import queues_pb2

logger = get_logger(__name__)


class PublishOutcome(enum.Enum):
    """How a publish ended."""

    ALL_ACKNOWLEDGED = "all_acknowledged"
    PARTIAL = "partial"
    NONE_ACKNOWLEDGED = "none_acknowledged"
    NO_WORKERS = "no_workers"


class PublishError(RuntimeError):
    """Some workers did not take the new weights and the publisher was told to require all."""


class _RoundFailed(RuntimeError):
    """Some workers failed a round: the next round retries them."""


DEFAULT_RETRY = RetryPolicy(attempts=3, initial_s=1.0, multiplier=2.0, max_s=60.0, jitter_s=0.0)
"""Rounds of one publish (the first included) and the pause before each retry round."""


@dataclass(frozen=True)
class PublishResult:
    """One publish: who acknowledged, who failed (with the last error), and the outcome."""

    version: int
    path: Path
    outcome: PublishOutcome
    workers_ok: tuple[str, ...]
    workers_failed: dict[str, str] = field(default_factory=dict)


class WeightPublisher:
    """Pushes weight versions to inference workers and announces them on the queue.

    Args:
        workers: Base URLs of the inference workers (may be empty: weights are only announced).
        queue: Where ``WeightsPublished`` goes.
        weights_dir: Root of the published version directories (``v<N>``), for retention.
        keep: Published versions kept on disk (older ones are deleted; workers load by path, so keep
            at least the versions still being loaded).
        retry: Rounds for the workers that failed a round, and the pauses between rounds; each
            worker's request is also tried twice within a round, with the same pauses.
        timeout_s: Per-request timeout of one worker's weight load.
        require_all: Raise ``PublishError`` when a worker still fails after the retries.
        spec_id: The run spec's id, carried by every ``WeightsPublished``.
        inference: The key the workers' admin routes require (and TLS for ``https://`` workers).
    """

    def __init__(
        self,
        workers: Sequence[str],
        queue: WorkQueue,
        *,
        weights_dir: Path,
        keep: int = 3,
        retry: RetryPolicy = DEFAULT_RETRY,
        timeout_s: float = 600.0,
        require_all: bool = False,
        spec_id: str = "",
        inference: InferenceEndpoint | None = None,
    ) -> None:
        self.queue = queue
        self.spec_id = spec_id
        self.weights_dir = Path(weights_dir)
        self.keep = max(1, keep)
        self.retry = retry
        self.require_all = require_all
        # One client per worker: each worker's retries are its own (the client never fails over
        # a weight update to another worker).
        self._per_request = retry.model_copy(update={"attempts": min(2, retry.attempts)})
        self._timeout_s = timeout_s
        self._inference = inference or InferenceEndpoint()
        self._clients = {url.rstrip("/"): self._client(url) for url in workers}
        self._retired: list[InferenceClient] = []
        self.unhealthy: dict[str, str] = {}

    def set_workers(self, urls: Sequence[str]) -> None:
        """Publish to ``urls`` from the next version on (inference discovery calls this); empty is ignored."""
        wanted = [u.rstrip("/") for u in urls]
        if not wanted:
            return
        for url in set(self._clients) - set(wanted):
            self._retired.append(self._clients.pop(url))
            self.unhealthy.pop(url, None)
        for url in wanted:
            if url not in self._clients:
                self._clients[url] = self._client(url)

    def _client(self, url: str) -> InferenceClient:
        return InferenceClient(
            [url],
            timeout_s=self._timeout_s,
            retry=self._per_request,
            api_key=self._inference.key(),
            tls=self._inference.tls,
        )

    def version_dir(self, version: int) -> Path:
        """Where version ``version`` is written."""
        return self.weights_dir / f"v{version:08d}"

    async def publish(self, version: int, path: Path, *, resuming: bool = False) -> PublishResult:
        """Make ``version`` (weights at ``path``) live on every worker, then announce it.

        Args:
            version: The new version; it must be above the published one (``latest``).
            path: Its weights directory.
            resuming: Completing an interrupted publication of ``version`` (``latest`` may already
                point at it; workers and the announcement are idempotent).

        Raises:
            AlreadyPublished: ``version`` was already published (published versions only go forward).
            PublishError: ``require_all`` and some worker never acknowledged (the announcement
                has still been published, naming the failures).
        """
        check_unpublished(self.weights_dir, version, resuming=resuming)
        point_latest(self.weights_dir, Path(path))  # what a restarted worker loads
        failed: dict[str, str] = {}
        ok: list[str] = []
        todo = list(self._clients)

        async def round_() -> None:
            results = await asyncio.gather(*(self._one(url, path, version) for url in todo))
            todo.clear()
            for r in results:
                if r.success:
                    ok.append(r.url)
                    failed.pop(r.url, None)
                else:
                    failed[r.url] = r.message
                    todo.append(r.url)
            if todo:
                raise _RoundFailed(f"{len(todo)} of {len(self._clients)} workers did not load v{version}")

        with contextlib.suppress(_RoundFailed):  # what still fails is reported below
            async for attempt in self.retry.async_retrying(
                _RoundFailed, logger=logger, what=f"publishing weight version {version}"
            ):
                with attempt:
                    await round_()
        for url in ok:
            self.unhealthy.pop(url, None)
        self.unhealthy.update(failed)
        if not self._clients:
            outcome = PublishOutcome.NO_WORKERS
        elif not failed:
            outcome = PublishOutcome.ALL_ACKNOWLEDGED
        elif ok:
            outcome = PublishOutcome.PARTIAL
        else:
            outcome = PublishOutcome.NONE_ACKNOWLEDGED
        if failed:
            logger.error(
                "weight version %d reached %d of %d workers; unhealthy: %s",
                version,
                len(ok),
                len(self._clients),
                "; ".join(f"{u}: {m}" for u, m in sorted(failed.items())),
            )
        message = queues_pb2.WeightsPublished(
            weight_version=version,
            checkpoint_path=str(path),
            workers_ok=sorted(ok),
            workers_failed=sorted(failed),
            published_at_ms=int(time.time() * 1000),
            spec_id=self.spec_id,
        )
        await self.queue.publish(WEIGHTS_PUBLISHED, message.SerializeToString(), key=f"weights-{version}")
        self._retain(version)
        result = PublishResult(version, Path(path), outcome, tuple(sorted(ok)), dict(failed))
        if failed and self.require_all:
            raise PublishError(
                f"weight version {version} was not acknowledged by {sorted(failed)} after "
                f"{self.retry.attempts} rounds; fix or remove those workers (last errors: {failed})"
            )
        return result

    async def _one(self, url: str, path: Path, version: int) -> WeightUpdateResult:
        try:
            (result,) = await self._clients[url].update_weights_from_disk(str(path), str(version))
        except Exception as exc:  # a boundary: any failure of one worker is that worker's outcome
            return WeightUpdateResult(url, False, f"{type(exc).__name__}: {exc}")
        return WeightUpdateResult(url, result.success, result.message, result.num_paused_requests)

    def _retain(self, current: int) -> None:
        if not self.weights_dir.is_dir():
            return
        versions = sorted(int(p.name[1:]) for p in self.weights_dir.iterdir() if p.is_dir() and p.name[1:].isdigit())
        for v in versions:
            if v <= current - self.keep:
                shutil.rmtree(self.version_dir(v), ignore_errors=True)

    async def close(self) -> None:
        """Close the HTTP clients."""
        for client in [*self._clients.values(), *self._retired]:
            await client.aclose()
