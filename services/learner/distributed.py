"""Process-group helpers for the sharded learner (``torchrun`` + FSDP2).

Single-process runs never touch ``torch.distributed``; under ``torchrun`` every rank runs the same
trainer, rank 0 alone talks to the queue, writes checkpoints and publishes weights.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class World:
    """This process's place in the (possibly trivial) process group."""

    rank: int = 0
    size: int = 1

    @property
    def distributed(self) -> bool:
        """Whether there is more than one rank."""
        return self.size > 1

    @property
    def is_main(self) -> bool:
        """Whether this rank talks to the outside world (queue, disk, inference workers)."""
        return self.rank == 0

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        """Element-wise sum of ``values`` over ranks (identity on one rank)."""
        if not self.distributed:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return [float(v) for v in t.tolist()]

    def all_reduce_max(self, values: list[float]) -> list[float]:
        """Element-wise max of ``values`` over ranks (identity on one rank)."""
        if not self.distributed:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [float(v) for v in t.tolist()]

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        """Wait for every rank."""
        if self.distributed:
            dist.barrier()


def init_world(backend: str | None = None) -> World:
    """Join the process group ``torchrun`` describes, or return the single-process world.

    Args:
        backend: ``nccl`` / ``gloo``; default ``nccl`` when CUDA is available, else ``gloo``.
    """
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return World()
    if not dist.is_initialized():
        chosen = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        dist.init_process_group(backend=chosen)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return World(rank=dist.get_rank(), size=dist.get_world_size())


def close_world() -> None:
    """Leave the process group, if this process joined one (every rank, once its work ended cleanly).

    Without it gloo's worker threads outlive the interpreter's teardown and the rank can abort
    (``terminate called without an active exception``) after its work is done. Not after a failure:
    leaving while other ranks are inside a collective can hang them (PyTorch's shutdown notes).
    """
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
