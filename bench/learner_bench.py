"""Benchmark: one GRPO training step on SmolLM2-135M on CPU, ours vs TRL's GRPOTrainer.

Both sides train the same batch (same token ids, masks, advantages) with the same settings: fp32,
the whole batch in one forward/backward, AdamW lr 1e-6, grad clip 1.0, clip 0.2/0.28, no KL. Ours is
``services.learner.trainer.Trainer.train_step``; TRL's is a real ``GRPOTrainer`` (its
``compute_loss`` + backward + its own optimizer and clipping) on inputs built the way it builds
them, without generation. Each side runs in its own process so peak memory is its own: the figure
is the growth of the peak resident set (VmHWM, reset before the step) over the loaded model.

Usage::

    .venv/bin/python bench/learner_bench.py [--batch 4] [--prompt 32] [--completion 96] [--steps 2] [--rounds 2]

The machine is shared, so sides alternate over rounds and the fastest step of each side counts.
Prints tokens/s and peak memory of each side and the ratios ours/TRL (tokens/s: higher is better;
memory: lower is better). Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _vm_hwm_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def _vm_rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _reset_peak() -> None:
    # Linux: writing 5 to clear_refs resets the peak resident set size (VmHWM) to the current RSS.
    Path("/proc/self/clear_refs").write_text("5")


def _batch(args: argparse.Namespace, vocab: int) -> tuple[Any, Any, Any, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    b, p, c = args.batch, args.prompt, args.completion
    ids = torch.randint(10, vocab, (b, p + c), generator=g)
    # Completions of different lengths (right padding), as real ones are.
    lengths = torch.randint(c // 2, c + 1, (b,), generator=g)
    completion_mask = (torch.arange(c)[None, :] < lengths[:, None]).long()
    advantages = torch.randn(b, generator=g)
    rollout = -torch.rand(b, c, generator=g) * 3 - 1
    return ids, completion_mask, advantages, rollout


def run_ours(args: argparse.Namespace, model_dir: Path) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM

    from services.learner.core.batching import Role, TrainSample
    from services.learner.core.losses import GrpoLossConfig, build_loss
    from services.learner.trainer import OptimConfig, Trainer

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.config.use_cache = False
    ids, cmask, adv, rollout = _batch(args, model.config.vocab_size)
    p = args.prompt
    samples = []
    for i in range(ids.shape[0]):
        n = p + int(cmask[i].sum())
        mask = (False,) * p + (True,) * (n - p)
        lps = (0.0,) * p + tuple(rollout[i, : n - p].tolist())
        samples.append(TrainSample(f"s{i}", Role.AGENT, tuple(ids[i, :n].tolist()), lps, mask, 0, float(adv[i])))
    total_tokens = args.batch * (args.prompt + args.completion)
    trainer = Trainer(
        model,
        build_loss(GrpoLossConfig(tis=args.tis)),
        OptimConfig(lr=1e-6, grad_clip=1.0, micro_batch_tokens=total_tokens, temperature=1.0),
        pad_id=0,
    )
    return _time(lambda: trainer.train_step(samples), args, total_tokens)


def _zero_reward(completions: list[Any], **kwargs: Any) -> list[float | None]:
    return [0.0] * len(completions)


def run_trl(args: argparse.Namespace, model_dir: Path) -> dict[str, float]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    ids, cmask, adv, _ = _batch(args, model.config.vocab_size)
    config = GRPOConfig(
        output_dir=str(Path(args.tmp) / "trl"),
        per_device_train_batch_size=args.batch,
        num_generations=args.batch,
        max_completion_length=args.completion,
        learning_rate=1e-6,
        max_grad_norm=1.0,
        beta=0.0,
        epsilon=0.2,
        epsilon_high=0.28,
        loss_type="bnpo",
        use_cpu=True,
        bf16=False,
        report_to=[],
        logging_steps=1,
        gradient_checkpointing=False,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=_zero_reward,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": ["x"] * args.batch}),
        processing_class=tokenizer,
    )
    optimizer = trainer.create_optimizer()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's train loop, which is bypassed here
    p = args.prompt
    inputs = {
        "prompt_ids": ids[:, :p],
        "prompt_mask": torch.ones(ids.shape[0], p, dtype=torch.long),
        "completion_ids": ids[:, p:],
        "completion_mask": cmask,
        "advantages": adv,
        "old_per_token_logps": None,
        "num_items_in_batch": cmask.sum(),
    }
    policy: Any = trainer.model
    policy.train()

    def step() -> None:
        loss = trainer.compute_loss(policy, inputs)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), config.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return _time(step, args, args.batch * (args.prompt + args.completion))


def _time(step: Callable[[], object], args: argparse.Namespace, tokens: int) -> dict[str, float]:
    import gc

    step()  # warm-up (allocator, optimizer state)
    gc.collect()
    base = _vm_rss_kib()
    _reset_peak()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    peak = _vm_hwm_kib()
    best = min(times)
    return {"tokens_per_s": tokens / best, "step_s": best, "peak_mib": (peak - base) / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--completion", type=int, default=96)
    parser.add_argument("--steps", type=int, default=2, help="Timed steps per process (after a warm-up).")
    parser.add_argument("--rounds", type=int, default=2, help="Alternating ours/TRL process pairs.")
    parser.add_argument("--tis", action="store_true", help="Our step with truncated IS (TRL side has none).")
    parser.add_argument("--side", choices=["ours", "trl"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--tmp", default="/tmp/spade-learner-bench", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.side is not None:
        from spade.inference.models import ensure_default_model

        model_dir = ensure_default_model()
        result = run_ours(args, model_dir) if args.side == "ours" else run_trl(args, model_dir)
        print(json.dumps(result))
        return

    runs: dict[str, list[dict[str, float]]] = {"ours": [], "trl": []}
    for _ in range(args.rounds):  # alternate the sides so load from other processes hits both alike
        for side in ("ours", "trl"):
            cmd = [sys.executable, __file__, "--side", side, *sys.argv[1:]]
            env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, cwd=ROOT)
            runs[side].append(json.loads(out.stdout.strip().splitlines()[-1]))
    results = {
        side: {
            "tokens_per_s": max(r["tokens_per_s"] for r in rs),
            "step_s": min(r["step_s"] for r in rs),
            "peak_mib": statistics.median(r["peak_mib"] for r in rs),
        }
        for side, rs in runs.items()
    }
    ours, trl = results["ours"], results["trl"]
    tokens = args.batch * (args.prompt + args.completion)
    print(f"SmolLM2-135M, CPU fp32, batch {args.batch} x ({args.prompt} prompt + {args.completion} completion)")
    print(f"= {tokens} tokens per step; fastest of {args.steps} steps x {args.rounds} alternating rounds per side")
    print(f"{'':8}{'tokens/s':>12}{'step s':>10}{'peak MiB':>12}")
    for side in ("ours", "trl"):
        r = results[side]
        print(f"{side:8}{r['tokens_per_s']:>12.1f}{r['step_s']:>10.2f}{r['peak_mib']:>12.1f}")
    print(f"ratio tokens/s ours/TRL: {ours['tokens_per_s'] / trl['tokens_per_s']:.3f}  (target >= 1.0)")
    print(f"ratio peak memory ours/TRL: {ours['peak_mib'] / max(trl['peak_mib'], 1e-9):.3f}  (lower is better)")


if __name__ == "__main__":
    main()
