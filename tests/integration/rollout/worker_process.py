"""A rollout worker as its own process, for the kill and SIGTERM tests (``python -m`` this with a JSON arg).

It is the real worker loop (``RolloutWorker.run`` under ``run_until_signalled``, as ``spade serve
rollout`` runs it) on the real Redis queue, the real Postgres state and memory, and the real sandbox
pool; only the policy is scripted (a real model cannot be steered). With ``hang_at`` set, the policy
writes ``ready_file`` and hangs on that model call, so the parent can kill the process mid-play.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from pathlib import Path

from services.memory.service import MemoryService
from services.memory.store.sql import SqlStore, make_engine
from services.rollout.memory import MemoryServicePlays
from services.rollout.policy import FormatterTemplate, Generation
from services.rollout.sandbox import PoolSessions
from services.rollout.state_store import RolloutStateStore
from services.rollout.worker import RolloutWorker, WorkerConfig
from services.sandbox.isolation import SandboxPool
from services.sandbox.isolation.settings import IsolationSettings
from spade.agent.episode import EpisodeRunner, PlayLimits
from spade.agent.ports import TurnSampling
from spade.inference.chat import ChatFormatter
from spade.inference.models import ensure_default_model
from spade.queues.config import RedisQueueConfig
from spade.queues.redis_streams import RedisStreamQueue
from spade.runspec import RunSpec
from spade.serving.run import run_until_signalled
from tests.unit.rollout.players import ScriptedPolicy


class StallingPolicy(ScriptedPolicy):
    """Answers like ``ScriptedPolicy`` and hangs on model call ``hang_at`` (counting from 1)."""

    ready_file: Path
    hang_at: int = 0

    async def generate(self, input_ids: list[int], sampling: TurnSampling) -> Generation:
        if self.hang_at and len(self.calls) + 1 >= self.hang_at:
            self.ready_file.write_text("mid-play")
            await asyncio.Event().wait()
        return await super().generate(input_ids, sampling)


async def main(args: dict[str, object], stop: asyncio.Event) -> None:
    spec = RunSpec.from_json(str(args["spec"]))
    template = FormatterTemplate(ChatFormatter.from_pretrained(ensure_default_model()))
    policy = StallingPolicy(template, ["\\boxed{0}"], weight_version=None)
    policy.ready_file, policy.hang_at = Path(str(args["ready_file"])), int(str(args["hang_at"]))
    queue = RedisStreamQueue(RedisQueueConfig(url=str(args["redis_url"]), prefix=str(args["prefix"])))
    engine = make_engine(str(args["memory_url"]))
    memory = MemoryServicePlays(MemoryService(SqlStore(engine)))
    pool = SandboxPool(IsolationSettings.model_validate({"wall_seconds": 10.0}))
    await pool.start()
    store = RolloutStateStore.from_url(str(args["state_url"]))
    try:
        limits = PlayLimits(max_turns=spec.agent_max_turns, max_tokens_per_turn=spec.agent_max_tokens_per_turn)
        runner = EpisodeRunner(PoolSessions(pool), policy, template, limits)
        config = WorkerConfig(
            consumer=str(args["name"]),
            spec=spec,
            max_concurrent_plays=1,
            lease_s=float(str(args["lease_s"])),
            shutdown_grace_s=float(str(args["grace_s"])),
            block_ms=100,
            poll_s=0.1,
        )
        worker = RolloutWorker(queue, store, memory, runner, config)
        Path(str(args["ready_file"]) + ".serving").write_text("serving")
        await worker.run(stop)
    finally:
        store.dispose()
        await pool.stop()
        await queue.close()
        engine.dispose()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    arguments = json.loads(sys.argv[1])
    run_until_signalled(lambda stop: main(arguments, stop))
