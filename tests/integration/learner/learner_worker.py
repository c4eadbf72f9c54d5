"""Run under ``torchrun --nproc_per_node 2``: the whole ``Learner`` sharded with FSDP2.

Rank 0 owns an in-process queue, feeds it the loop test's samples and runs three steps; rank 1
follows (``collective.Follower``). Rank 0 writes ``result.pt`` into the directory given as the first
argument. Driven by ``test_sharded.py``; not a test module itself.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import torch

from services.learner.checkpoint import full_model_state
from services.learner.distributed import close_world, init_world
from services.learner.learner import Learner
from services.learner.wiring import build_follower, build_learner
from spade.queues.inprocess import InProcessQueue
from tests.integration.learner.conftest import SPEC, make_settings
from tests.integration.learner.test_learner_loop import phase_one, phase_two


async def lead(learner: Learner, queue: InProcessQueue) -> list[dict[str, float]]:
    await phase_one(queue)
    reports = [await learner.run_step()]
    await phase_two(queue)
    reports += [await learner.run_step(), await learner.run_step()]
    await learner.run(max_steps=0)  # tells the followers to stop
    return [r.flat_metrics() for r in reports]


def main(out: Path, base: Path) -> None:
    world = init_world("gloo")
    settings = make_settings(out, base, keep_checkpoints=3)
    if world.is_main:
        queue = InProcessQueue()
        learner = build_learner(settings, spec=SPEC, queue=queue, world=world)
        metrics = asyncio.run(lead(learner, queue))
        trainer = learner.trainer
    else:
        follower = build_follower(settings, spec=SPEC, world=world)
        follower.follow()
        trainer = follower.trainer
    state = full_model_state(trainer.model)
    if world.is_main:
        torch.save({"metrics": metrics, "state": state, "version": learner.version}, out / "result.pt")
    world.barrier()  # rank 0's result is on disk before either rank leaves the group
    close_world()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
