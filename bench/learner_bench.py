"""Benchmark: one GRPO training step on SmolLM2-135M on CPU, ours vs TRL's GRPOTrainer.

The batch looks like the learner's real one: ``--batch`` agent plays whose lengths are spread evenly
between ``--min-len`` and ``--max-len`` tokens (default 8 plays of 256…1024 tokens), each a prompt of
``--prompt`` untrained tokens followed by turns of ``--turn`` trained (model) tokens alternating
with ``--obs`` untrained (observation) tokens. Both sides train the same token ids, masks and
advantages with the same settings: fp32, the whole batch in one optimiser step, AdamW lr 1e-6, grad
clip 1.0, clip 0.2/0.28, no KL, no gradient checkpointing, and the same memory budget per
forward/backward pass: ``--micro-batches`` K passes of ``batch / K × max-len`` tokens (K = 2 by
default: TRL's fp32 pass over all 8 × 1024 padded tokens needs more than the 23 GB of this machine).

- ``ours``: ``services.learner.trainer.Trainer.train_step``, ``micro_batch_tokens = batch / K ×
  max-len``: the plays are packed (no padding) into as few passes as fit;
- ``ours-padded`` (``--sides``): the same trainer with packing off (one right-padded row per play,
  the budget counting padded tokens), to see what packing buys;
- ``ours-bf16`` (``--sides``): the same trainer with ``cpu_bf16`` (bf16 autocast on the CPU, fp32
  weights, gradients and optimiser state), what the embedded run trains with on a CPU with native bf16;
- ``ours-bf16-sdpa`` (``--sides``): ``ours-bf16`` with the attention kernel off (``SPADE_ATTENTION_KERNEL=0``:
  torch's SDPA attends), to see what the kernel (``spade.attention``) buys;
- ``ours-unshared`` (``--sides``): the same trainer with ``share_prefixes`` off. With ``--group G`` the
  plays come in groups of G with one prompt, as an env's G plays do: ``ours`` computes each group's
  prompt once (``core.collate.pack``), ``ours-unshared`` and TRL once per play;
- ``trl``: a real ``GRPOTrainer`` (its ``compute_loss`` + backward + its optimizer and clipping) on
  inputs built the way it builds them (``tool_mask`` = the untrained observation tokens), without
  generation, with its own gradient accumulation over K chunks of ``batch / K`` plays (each padded
  to its longest completion).

Each side runs in its own process so its peak memory is its own: the figure is the growth of the
peak resident set (VmHWM, reset before the timed step) over the resident set after a warm-up step
on two short plays (model, optimizer state, allocator). tokens/s counts the batch's real tokens on
every side (padding is work, not throughput).

Usage::

    .venv/bin/python bench/learner_bench.py [--batch 8] [--min-len 256] [--max-len 1024] [--steps 1]
        [--micro-batches 2] [--group 1] [--rounds 1] [--sides ours,trl] [--threads 1] [--json]

``--json`` prints one object: the settings, ``os.getloadavg()`` at start, our figures, the
baseline's (TRL's) figures and the ratios. Sides alternate over rounds (the machine is shared);
the fastest step of each side counts. Besides wall-clock tokens/s, tokens per CPU-second (the step's
process CPU time) are reported: with one torch thread per side they are far less sensitive to other
processes on a shared machine. Not a test: nothing is asserted.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SIDES = ("ours", "ours-padded", "ours-bf16", "ours-bf16-sdpa", "ours-unshared", "trl")


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    return 0


def _reset_peak() -> None:
    # Linux: writing 5 to clear_refs resets the peak resident set size (VmHWM) to the current RSS.
    Path("/proc/self/clear_refs").write_text("5")


@dataclass(frozen=True)
class Play:
    """One synthetic agent play: token ids, the trained-token mask, rollout logprobs, advantage."""

    ids: list[int]
    mask: list[bool]
    rollout: list[float]
    advantage: float


def lengths(args: argparse.Namespace) -> list[int]:
    """Play lengths spread evenly over ``[min_len, max_len]``, in a shuffled order."""
    n = args.batch
    spread = [round(args.min_len + (args.max_len - args.min_len) * i / max(n - 1, 1)) for i in range(n)]
    order = sorted(range(n), key=lambda i: (i * 5) % n)  # deterministic shuffle: lengths not sorted
    return [spread[i] for i in order]


def plays(args: argparse.Namespace, vocab: int, sizes: list[int] | None = None) -> list[Play]:
    """The benchmark batch (deterministic): prompt, then trained turns and untrained observations."""
    import torch

    g = torch.Generator().manual_seed(0)
    out: list[Play] = []
    for n in sizes if sizes is not None else lengths(args):
        ids = torch.randint(10, vocab, (n,), generator=g).tolist()
        if len(out) % args.group:  # a group's plays share their first play's prompt
            leader = out[len(out) - len(out) % args.group].ids
            ids[: args.prompt] = leader[: args.prompt]
        mask = [False] * min(args.prompt, n)
        while len(mask) < n:
            mask += [True] * min(args.turn, n - len(mask))
            mask += [False] * min(args.obs, n - len(mask))
        rollout = [float(-torch.rand((), generator=g) * 3 - 0.5) if m else 0.0 for m in mask]
        out.append(Play(ids, mask, rollout, float(torch.randn((), generator=g))))
    return out


def run_ours(
    args: argparse.Namespace, model_dir: Path, packed: bool, bf16: bool = False, share: bool = True
) -> dict[str, float]:
    import torch

    from services.learner.core.batching import Role, TrainSample
    from services.learner.core.losses import GrpoLossConfig, build_loss
    from services.learner.trainer import OptimConfig, Trainer
    from services.learner.wiring import load_policy

    model = load_policy(model_dir, torch.device("cpu"))  # the learner's own: oneDNN products on the CPU

    def samples(batch: list[Play]) -> list[TrainSample]:
        return [
            TrainSample(f"s{i}", Role.AGENT, tuple(p.ids), tuple(p.rollout), tuple(p.mask), 0, p.advantage)
            for i, p in enumerate(batch)
        ]

    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    batch = samples(plays(args, vocab))
    warm = samples(plays(args, vocab, [args.prompt + 8, args.prompt + 16]))
    budget = args.batch // args.micro_batches * args.max_len  # what one TRL micro-batch holds, padded
    trainer = Trainer(
        model,
        build_loss(GrpoLossConfig(tis=args.tis)),
        OptimConfig(
            lr=1e-6,
            grad_clip=1.0,
            micro_batch_tokens=budget,
            temperature=1.0,
            packed=packed,
            cpu_bf16=bf16,
            share_prefixes=share,
        ),
        pad_id=0,
    )
    return _time(lambda: trainer.train_step(warm), lambda: trainer.train_step(batch), args)


def _zero_reward(completions: list[Any], **kwargs: Any) -> list[float | None]:
    return [0.0] * len(completions)


def run_trl(args: argparse.Namespace, model_dir: Path) -> dict[str, float]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    config = GRPOConfig(
        output_dir=str(Path(args.tmp) / "trl"),
        per_device_train_batch_size=args.batch // args.micro_batches,
        gradient_accumulation_steps=args.micro_batches,
        num_generations=args.batch,
        max_completion_length=args.max_len - args.prompt,
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
    trainer.current_gradient_accumulation_steps = args.micro_batches  # set by Trainer's loop, bypassed here
    p = args.prompt

    def inputs(batch: list[Play]) -> dict[str, Any]:
        width = max(len(x.ids) for x in batch) - p
        completion = torch.zeros(len(batch), width, dtype=torch.long)
        completion_mask = torch.zeros(len(batch), width, dtype=torch.long)
        tool_mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, x in enumerate(batch):
            n = len(x.ids) - p
            completion[row, :n] = torch.tensor(x.ids[p:])
            completion_mask[row, :n] = 1
            tool_mask[row, :n] = torch.tensor(x.mask[p:], dtype=torch.long)
        return {
            "prompt_ids": torch.tensor([x.ids[:p] for x in batch]),
            "prompt_mask": torch.ones(len(batch), p, dtype=torch.long),
            "completion_ids": completion,
            "completion_mask": completion_mask,
            "tool_mask": tool_mask,
            "advantages": torch.tensor([x.advantage for x in batch]),
            "old_per_token_logps": None,
            "num_items_in_batch": (completion_mask * tool_mask).sum(),
        }

    every = plays(args, model.config.vocab_size)
    per = args.batch // args.micro_batches
    chunks = [inputs(every[i : i + per]) for i in range(0, len(every), per)]
    warm = [inputs(plays(args, model.config.vocab_size, [p + 8, p + 16]))]
    policy: Any = trainer.model
    policy.train()

    def step(data: list[dict[str, Any]]) -> None:
        for chunk in data:  # TRL's gradient accumulation: one backward per micro-batch
            trainer.compute_loss(policy, chunk).backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), config.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return _time(lambda: step(warm), lambda: step(chunks), args)


def _time(warm: Callable[[], object], step: Callable[[], object], args: argparse.Namespace) -> dict[str, float]:
    import gc

    warm()  # optimizer state, allocator, first-call overheads
    gc.collect()
    base = _status_kib("VmRSS")
    _reset_peak()
    times, cpu = [], []
    for _ in range(args.steps):
        start, start_cpu = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    peak = _status_kib("VmHWM")
    return {"step_s": min(times), "step_cpu_s": min(cpu), "peak_mib": (peak - base) / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8, help="plays per step")
    parser.add_argument("--min-len", type=int, default=256, help="shortest play (tokens)")
    parser.add_argument("--max-len", type=int, default=1024, help="longest play (tokens)")
    parser.add_argument("--prompt", type=int, default=128, help="untrained prompt tokens at the start of each play")
    parser.add_argument("--turn", type=int, default=48, help="trained tokens per model turn")
    parser.add_argument("--obs", type=int, default=32, help="untrained tokens per observation")
    parser.add_argument("--group", type=int, default=1, help="plays per prompt (an env's G plays share theirs)")
    parser.add_argument(
        "--micro-batches",
        type=int,
        default=2,
        help="forward/backward passes per step (TRL: gradient accumulation; ours: batch/K x max-len tokens each)",
    )
    parser.add_argument("--steps", type=int, default=1, help="timed steps per process (after a warm-up)")
    parser.add_argument("--rounds", type=int, default=1, help="alternating rounds of the sides")
    parser.add_argument("--sides", default="ours,trl", help=f"comma-separated, among {', '.join(SIDES)}")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads per side (1 by default: on a shared machine two threads per process contend)",
    )
    parser.add_argument("--tis", action="store_true", help="our step with truncated IS (TRL side has none)")
    parser.add_argument("--json", action="store_true", help="print one JSON object with every figure")
    parser.add_argument("--side", choices=SIDES, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--tmp", default="/tmp/spade-learner-bench", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not 2 <= args.prompt + 1 < args.min_len <= args.max_len:
        parser.error("need 2 <= prompt + 1 < min-len <= max-len: every play needs trained tokens after its prompt")
    if args.group < 1:
        parser.error(f"--group must be at least 1, got {args.group}")
    if args.micro_batches < 1 or args.batch % args.micro_batches:
        parser.error(f"--micro-batches must divide --batch ({args.batch}), got {args.micro_batches}")

    if args.side is not None:
        import torch

        from spade.inference.models import ensure_default_model

        torch.set_num_threads(args.threads)

        model_dir = ensure_default_model()
        if args.side == "trl":
            result = run_trl(args, model_dir)
        else:
            packed, share = args.side != "ours-padded", args.side != "ours-unshared"
            autocast = args.side in ("ours-bf16", "ours-bf16-sdpa")
            result = run_ours(args, model_dir, packed=packed, bf16=autocast, share=share)
        print(json.dumps(result))
        return

    load_at_start = os.getloadavg()
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    if not sides or any(s not in SIDES for s in sides):
        parser.error(f"--sides takes a comma-separated list among {SIDES}, got {args.sides!r}")
    runs: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
    failures: dict[str, str] = {}
    passthrough = [a for a in sys.argv[1:] if a != "--json"]
    for _ in range(args.rounds):  # alternate the sides so load from other processes hits them alike
        for side in sides:
            cmd = [sys.executable, __file__, "--side", side, *passthrough]
            env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
            if side.endswith("-sdpa"):
                env["SPADE_ATTENTION_KERNEL"] = "0"
            out = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, cwd=ROOT)
            if out.returncode != 0:  # e.g. killed for memory: say so, keep the other sides' figures
                failures[side] = f"exit status {out.returncode}: {out.stderr.strip()[-500:]}"
                print(f"{side}: failed, {failures[side]}", file=sys.stderr, flush=True)
                continue
            runs[side].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"{side}: {runs[side][-1]}", file=sys.stderr, flush=True)
    runs = {side: rs for side, rs in runs.items() if rs}
    sizes = lengths(args)
    tokens = sum(sizes)
    trained = sum(sum(p.mask[1:]) for p in plays(args, 100, sizes))
    results = {}
    for side, rs in runs.items():
        step_s = min(r["step_s"] for r in rs)
        cpu_s = min(r["step_cpu_s"] for r in rs)
        results[side] = {
            "tokens_per_s": tokens / step_s,
            "tokens_per_cpu_s": tokens / cpu_s,
            "step_s": step_s,
            "step_cpu_s": cpu_s,
            "peak_mib": statistics.median(r["peak_mib"] for r in rs),
        }
    ratios: dict[str, float] = {}
    for side in results:
        if side != "trl" and "trl" in results:
            ratios[f"{side}_vs_trl_tokens_per_s"] = results[side]["tokens_per_s"] / results["trl"]["tokens_per_s"]
            ratios[f"{side}_vs_trl_tokens_per_cpu_s"] = (
                results[side]["tokens_per_cpu_s"] / results["trl"]["tokens_per_cpu_s"]
            )
            ratios[f"{side}_vs_trl_peak_mib"] = results[side]["peak_mib"] / max(results["trl"]["peak_mib"], 1e-9)
    if "ours" in results and "ours-padded" in results:
        padded = results["ours-padded"]
        ratios["packed_vs_padded_tokens_per_s"] = results["ours"]["tokens_per_s"] / padded["tokens_per_s"]
        ratios["packed_vs_padded_tokens_per_cpu_s"] = results["ours"]["tokens_per_cpu_s"] / padded["tokens_per_cpu_s"]
        ratios["packed_vs_padded_peak_mib"] = results["ours"]["peak_mib"] / max(padded["peak_mib"], 1e-9)
    if "ours" in results and "ours-unshared" in results:
        unshared = results["ours-unshared"]
        ratios["shared_vs_unshared_tokens_per_s"] = results["ours"]["tokens_per_s"] / unshared["tokens_per_s"]
        ratios["shared_vs_unshared_tokens_per_cpu_s"] = (
            results["ours"]["tokens_per_cpu_s"] / unshared["tokens_per_cpu_s"]
        )
        ratios["shared_vs_unshared_peak_mib"] = results["ours"]["peak_mib"] / max(unshared["peak_mib"], 1e-9)
    if "ours" in results and "ours-bf16" in results:
        bf16 = results["ours-bf16"]
        ratios["bf16_vs_fp32_tokens_per_s"] = bf16["tokens_per_s"] / results["ours"]["tokens_per_s"]
        ratios["bf16_vs_fp32_tokens_per_cpu_s"] = bf16["tokens_per_cpu_s"] / results["ours"]["tokens_per_cpu_s"]
        ratios["bf16_vs_fp32_peak_mib"] = bf16["peak_mib"] / max(results["ours"]["peak_mib"], 1e-9)
    if "ours-bf16" in results and "ours-bf16-sdpa" in results:
        sdpa = results["ours-bf16-sdpa"]
        ratios["kernel_vs_sdpa_tokens_per_s"] = results["ours-bf16"]["tokens_per_s"] / sdpa["tokens_per_s"]
        ratios["kernel_vs_sdpa_tokens_per_cpu_s"] = results["ours-bf16"]["tokens_per_cpu_s"] / sdpa["tokens_per_cpu_s"]
    settings = {
        "model": "SmolLM2-135M-Instruct",
        "device": "cpu",
        "dtype": "float32 (ours-bf16: bf16 products under autocast)",
        "batch": args.batch,
        "lengths": sizes,
        "tokens": tokens,
        "padded_tokens": args.batch * max(sizes),
        "trained_tokens": trained,
        "prompt": args.prompt,
        "turn": args.turn,
        "obs": args.obs,
        "group": args.group,
        "micro_batches": args.micro_batches,
        "micro_batch_tokens": args.batch // args.micro_batches * args.max_len,
        "steps": args.steps,
        "rounds": args.rounds,
        "torch_threads": args.threads,
    }
    if args.json:
        report = {
            "benchmark": "learner",
            "loadavg_start": list(load_at_start),
            "settings": settings,
            "figures": {side: r for side, r in results.items() if side != "trl"},
            "baseline": {"name": "trl GRPOTrainer", **results["trl"]} if "trl" in results else None,
            "ratios": ratios,
            "runs": runs,
            "failures": failures,
        }
        print(json.dumps(report, indent=2))
        return
    print(
        f"SmolLM2-135M, CPU fp32, {args.batch} plays of {min(sizes)}..{max(sizes)} tokens = {tokens} tokens "
        f"({args.batch * max(sizes)} padded), {trained} trained; load average at start {load_at_start[0]:.2f}"
    )
    print(
        f"{args.micro_batches} passes of <= {settings['micro_batch_tokens']} tokens per step; "
        f"fastest of {args.steps} step(s) x {args.rounds} round(s) per side"
    )
    print(f"{'':12}{'tokens/s':>12}{'tokens/cpu-s':>14}{'step s':>10}{'cpu s':>10}{'peak MiB':>12}")
    for side, r in results.items():
        print(
            f"{side:12}{r['tokens_per_s']:>12.1f}{r['tokens_per_cpu_s']:>14.1f}{r['step_s']:>10.2f}"
            f"{r['step_cpu_s']:>10.2f}{r['peak_mib']:>12.1f}"
        )
    for name, value in ratios.items():
        print(f"{name}: {value:.3f}")
    for side, why in failures.items():
        print(f"{side} failed: {why}")
    print("(tokens/s: higher is better, target ours/TRL >= 2; peak memory: lower is better, target ours/TRL <= 1)")


if __name__ == "__main__":
    main()
