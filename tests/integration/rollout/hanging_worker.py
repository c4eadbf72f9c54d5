"""A rollout worker process that stalls mid-play, for the kill test (``python -m`` this with a JSON arg).

It serves the real Redis queue with the real worker loop; its policy answers the first turn, then
writes ``ready_file`` and hangs, so the parent can SIGKILL it while a play is in flight.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from services.memory.service import MemoryService
from services.memory.store.sql import SqlStore, make_engine
from services.rollout.core.episode import EpisodeRunner, PlayLimits
from services.rollout.core.ports import TurnSampling
from services.rollout.memory import MemoryServicePlays
from services.rollout.policy import FormatterTemplate, Generation
from services.rollout.state_store import RolloutStateStore
from services.rollout.worker import RolloutWorker, WorkerConfig
from spade.inference.chat import ChatFormatter
from spade.inference.models import ensure_default_model
from spade.queues.config import RedisQueueConfig
from spade.queues.redis_streams import RedisStreamQueue
from tests.unit.rollout.envs import CountdownEnv
from tests.unit.rollout.players import LocalSessions, ScriptedPolicy


class StallingPolicy(ScriptedPolicy):
    ready_file: Path

    async def generate(self, input_ids: list[int], sampling: TurnSampling) -> Generation:
        if self.calls:
            self.ready_file.write_text("mid-play")
            await asyncio.Event().wait()
        return await super().generate(input_ids, sampling)


async def main(args: dict[str, str]) -> None:
    template = FormatterTemplate(ChatFormatter.from_pretrained(ensure_default_model()))
    policy = StallingPolicy(template, ["\\boxed{0}"], weight_version=None)
    policy.ready_file = Path(args["ready_file"])
    queue = RedisStreamQueue(RedisQueueConfig(url=args["redis_url"], prefix=args["prefix"], claim_idle_ms=500))
    memory = MemoryServicePlays(MemoryService(SqlStore(make_engine(args["memory_url"]))))
    sessions = LocalSessions({args["code"]: CountdownEnv})
    runner = EpisodeRunner(sessions, policy, template, PlayLimits(max_turns=2, max_tokens_per_turn=32))
    config = WorkerConfig(consumer="doomed", group_size=int(args["group_size"]), block_ms=50, poll_s=0.05)
    worker = RolloutWorker(queue, RolloutStateStore.from_url(args["state_url"]), memory, memory, runner, config)
    await worker.run(asyncio.Event())


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
