"""Run under ``torchrun --nproc_per_node 2``: one FSDP2-sharded step, a checkpoint, and a reload; and
one step on a batch whose env groups share prompts (each group dealt whole to one rank).

Writes ``result.pt`` (rank 0) into the directory given as the first argument. Driven by
``test_sharded.py``; not a test module itself.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from services.learner.checkpoint import CheckpointManager, full_model_state
from services.learner.core.losses import GrpoLossConfig, build_loss
from services.learner.distributed import init_world
from services.learner.trainer import OptimConfig, Trainer, shard_model
from tests.unit.learner.conftest import grouped_batch, random_batch, tiny_llama

LOSS = GrpoLossConfig(kl_coef=0.05)
OPTIM = OptimConfig(lr=1e-3, micro_batch_tokens=40)
SHARED_OPTIM = OptimConfig(lr=1e-3, micro_batch_tokens=128)


def shared_batch() -> list:
    """Two envs' plays, each group sharing its prompt, and unrelated samples."""
    return grouped_batch(seed=3) + grouped_batch(seed=4)


def main(out: Path) -> None:
    world = init_world("gloo")
    model, ref = tiny_llama(seed=0), tiny_llama(seed=7)
    shard_model(model)
    shard_model(ref)
    trainer = Trainer(model, build_loss(LOSS), OPTIM, ref_model=ref, world=world)
    metrics = trainer.train_step(random_batch(n=7, seed=21))
    ckpt = CheckpointManager(out / "ckpt", keep=1, world=world)
    ckpt.save(1, model, trainer.optimizer, {"version": 1})
    world.barrier()
    state = full_model_state(model)

    fresh = tiny_llama(seed=3)
    shard_model(fresh)
    fresh_opt = Trainer(fresh, build_loss(LOSS), OPTIM, world=world).optimizer
    restored = ckpt.load(fresh, fresh_opt)
    reloaded = full_model_state(fresh)

    model, ref = tiny_llama(seed=0), tiny_llama(seed=7)
    shard_model(model)
    shard_model(ref)
    shared = Trainer(model, build_loss(LOSS), SHARED_OPTIM, ref_model=ref, world=world)
    shared_metrics = shared.train_step(shared_batch())
    if world.is_main:
        optim = torch.load(out / "ckpt" / "step-00000001" / "optimizer.pt", weights_only=False)
        torch.save(
            {
                "metrics": metrics.as_dict(),
                "state": state,
                "reloaded": reloaded,
                "restored_step": restored.step if restored else None,
                "optim": optim,
                "world": world.size,
                "shared_metrics": shared_metrics.as_dict(),
                "shares_prefixes": shared.share_prefixes,
            },
            out / "result.pt",
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
