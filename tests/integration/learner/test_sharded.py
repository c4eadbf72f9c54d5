"""The sharded (FSDP2, ``torchrun``) training path in two CPU processes over gloo.

The same batch trained by one process and by two FSDP2 ranks must give the same loss, gradient
norm and gradients (Adam's first moment is 0.1 × the clipped gradient, compared name by name), and
a sharded checkpoint must reload into a freshly sharded model exactly. A batch whose env groups share
prompts is dealt to the ranks a group at a time: the two ranks compute each prompt once, as one
process does, and make the same update.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.learner.trainer import Trainer

from ...unit.learner.conftest import random_batch, tiny_llama
from .sharded_worker import LOSS, OPTIM, SHARED_OPTIM, shared_batch

ROOT = Path(__file__).resolve().parents[3]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.model
@pytest.mark.slow
def test_two_fsdp2_ranks_match_one_process(tmp_path):
    from services.learner.core.losses import build_loss

    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(_free_port()),
        str(Path(__file__).with_name("sharded_worker.py")),
        str(tmp_path),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = torch.load(tmp_path / "result.pt", weights_only=False)
    assert result["world"] == 2 and result["restored_step"] == 1

    model, ref = tiny_llama(seed=0), tiny_llama(seed=7)
    trainer = Trainer(model, build_loss(LOSS), OPTIM, ref_model=ref)
    single = trainer.train_step(random_batch(n=7, seed=21))
    sharded = result["metrics"]
    for key in ("loss", "kl", "grad_norm", "logp_diff_mean", "logp_diff_max", "tis_mean"):
        assert sharded[key] == pytest.approx(getattr(single, key), rel=1e-5, abs=1e-7), key
    assert sharded["trained_tokens"] == single.trained_tokens and sharded["samples"] == single.samples

    names = [n for n, _ in model.named_parameters()]
    optim_state = result["optim"]["state"]
    for name, p in zip(names, model.parameters(), strict=True):
        ours = trainer.optimizer.state[p]["exp_avg"]
        theirs = optim_state[name]["exp_avg"]
        assert torch.allclose(ours, theirs, atol=1e-8, rtol=1e-4), name
    for name, value in model.state_dict().items():
        assert torch.allclose(result["state"][name], value, atol=1e-6), name
        assert torch.equal(result["reloaded"][name], result["state"][name]), name

    # Shared prompts: each group on one rank, so the ranks together compute what one process does
    # (dealt one sample at a time, both ranks would compute both prompts).
    alone = Trainer(tiny_llama(seed=0), build_loss(LOSS), SHARED_OPTIM, ref_model=tiny_llama(seed=7))
    one = alone.train_step(shared_batch())
    two = result["shared_metrics"]
    assert result["shares_prefixes"] and alone.share_prefixes
    assert two["row_tokens"] == one.row_tokens < one.tokens
    for key in ("loss", "kl", "grad_norm", "logp_diff_mean", "tis_mean"):
        assert two[key] == pytest.approx(getattr(one, key), rel=1e-5, abs=1e-7), key
    assert two["trained_tokens"] == one.trained_tokens and two["samples"] == one.samples


@pytest.mark.slow
async def test_the_whole_learner_sharded_over_two_ranks_matches_one_process(tmp_path, base_model):
    from services.learner.wiring import build_learner, close_learner
    from spade.queues.inprocess import InProcessQueue

    from .conftest import SPEC, make_settings
    from .test_learner_loop import phase_one, phase_two

    sharded_dir = tmp_path / "sharded"
    sharded_dir.mkdir()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(_free_port()),
        str(Path(__file__).with_name("learner_worker.py")),
        str(sharded_dir),
        str(base_model),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = await asyncio.create_subprocess_exec(
        *cmd, cwd=ROOT, env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
    )
    _, stderr = await asyncio.wait_for(proc.communicate(), timeout=300)
    assert proc.returncode == 0, stderr.decode()[-4000:]
    result = torch.load(sharded_dir / "result.pt", weights_only=False)

    single_dir = tmp_path / "single"
    queue = InProcessQueue()
    learner = build_learner(make_settings(single_dir, base_model, keep_checkpoints=3), spec=SPEC, queue=queue)
    await phase_one(queue)
    reports = [await learner.run_step()]
    await phase_two(queue)
    reports += [await learner.run_step(), await learner.run_step()]
    await close_learner(learner)

    assert result["version"] == learner.version == 3
    for ours, theirs in zip([r.flat_metrics() for r in reports], result["metrics"], strict=True):
        for key in ("loss", "grad_norm", "trained_tokens", "samples", "designer/blend_mean"):
            if key not in ours:
                assert key not in theirs, key
                continue
            assert theirs[key] == pytest.approx(ours[key], rel=1e-4, abs=1e-7), key
        assert {k: v for k, v in theirs.items() if k.startswith("count/")} == {
            k: v for k, v in ours.items() if k.startswith("count/")
        }
    # Step 1's gradients (Adam's first moment, saved in the step-1 checkpoint) agree name by name.
    sharded_optim = torch.load(sharded_dir / "ckpt" / "step-00000001" / "optimizer.pt", weights_only=False)
    single_optim = torch.load(single_dir / "ckpt" / "step-00000001" / "optimizer.pt", weights_only=False)
    for name, state in single_optim["state"].items():
        assert torch.allclose(state["exp_avg"], sharded_optim["state"][name]["exp_avg"], atol=1e-8, rtol=1e-4), name
    assert set(result["state"]) == set(learner.trainer.model.state_dict())
