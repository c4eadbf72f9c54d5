"""Benchmark: the warm start's SFT on SmolLM2-135M on CPU, our plain loop vs TRL's SFTTrainer.

Every side trains the same real pairs — designer prompts rendered by the designer's own code at the
warm start's prompt budget, each followed by a family answer and EOS (not sandbox-validated here:
only the cost is measured) — with the same settings: fp32, one unpadded sequence per forward, the
loss on the answer tokens only, ``--batch`` sequences per optimiser step (gradient accumulation),
AdamW lr 1e-4, grad clip 1.0, no gradient checkpointing.

- ``loop``: ``services.embedded.warmstart.train.train`` (exact gradient, only the answer positions
  reach the LM head);
- ``loop-context``: the same loop with ``prompt_gradient=False`` (the prompt as a fixed KV cache:
  cheaper, approximate gradient);
- ``trl``: a real ``trl.SFTTrainer`` on the pre-tokenised pairs (``input_ids`` + ``labels`` with -100
  on the prompt), ``per_device_train_batch_size=1`` and ``gradient_accumulation_steps=--batch``.

Each side runs in its own process for ``1 + --steps`` optimiser steps over ``(1 + steps) × batch``
pairs; the first step is a warm-up and is not timed. tokens/s counts prompt and answer tokens of
the timed steps; the CPU figure is tokens per CPU-second of the process (less sensitive to other
load on a shared machine); peak is the growth of the peak resident set (VmHWM, reset after the
model is loaded) — model, gradients, optimizer state and activations. Sides run with
``OMP_WAIT_POLICY=PASSIVE`` unless the environment sets it: on a busy machine OpenMP's spinning
threads otherwise waste most of the CPU (measured here: a decode step 12x slower with two spinning
threads than with passive ones). Not a test: nothing is asserted.

Usage::

    .venv/bin/python bench/warmstart_bench.py [--steps 2] [--batch 2] [--prompt-tokens 1024]
        [--sides loop,loop-context,trl] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from spade.inference.answer_format import designer_answer

ROOT = Path(__file__).resolve().parents[1]
SIDES = ("loop", "loop-context", "trl")


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    return 0


def _reset_peak() -> None:
    # Linux: writing 5 to clear_refs resets the peak resident set size (VmHWM) to the current RSS.
    Path("/proc/self/clear_refs").write_text("5")


def build_pairs(count: int, prompt_tokens: int, out: Path) -> None:
    """Render ``count`` real (prompt, answer) token sequences into ``out`` (JSON)."""
    from services.designer.core.prompts import AgentBudget, fit_prompt
    from services.designer.corpus.builder import ensure_default_corpus
    from services.designer.corpus.loader import load_jsonl
    from services.designer.wiring import load_examples
    from services.embedded.warmstart.data import PairConfig, answer_ids, plan_pairs, prompt_parts, split_documents
    from spade.envs.families import seed_pool_envs, training_families
    from spade.inference.chat import ChatFormatter
    from spade.inference.models import ensure_default_model

    formatter = ChatFormatter.from_pretrained(ensure_default_model())
    config = PairConfig(count=count, max_prompt_tokens=prompt_tokens, budget=AgentBudget(3, 48))
    train_docs, _ = split_documents(load_jsonl(ensure_default_corpus("game")), 64, 0)
    planned = plan_pairs(
        config,
        families=training_families("game"),
        documents=train_docs,
        examples=load_examples("game"),
        memory_pool=seed_pool_envs("game"),
    )
    rows = []
    for item in planned:
        fitted = fit_prompt(prompt_parts(config, item), formatter.apply, max_prompt_tokens=prompt_tokens)
        rows.append(
            {
                "prompt": fitted.prompt_ids,
                "answer": answer_ids(designer_answer(item.env.code, item.env.hint), formatter.tokenizer),
            }
        )
    out.write_text(json.dumps(rows))


def run_loop(rows: list[dict[str, Any]], args: argparse.Namespace, prompt_gradient: bool) -> dict[str, Any]:
    import torch

    from services.embedded.warmstart.train import SFTConfig, StepRecord, load_for_training, train, training_sequence
    from spade.inference.models import ensure_default_model

    torch.set_num_threads(args.threads)
    model, _ = load_for_training(ensure_default_model())
    sequences = [training_sequence(r["prompt"], r["answer"]) for r in rows]
    stamps: list[tuple[float, float]] = []

    def progress(phase: str, done: float, total: float) -> None:
        stamps.append((time.perf_counter(), time.process_time()))

    _reset_peak()
    base = _status_kib("VmRSS")
    config = SFTConfig(
        epochs=1, lr=1e-4, batch_size=args.batch, warmup_steps=0, prompt_gradient=prompt_gradient, seed=0
    )
    # The loop shuffles the order per epoch: the timed steps are whatever follows the first one.
    result = train(model, sequences, config, progress=progress)
    curve: list[StepRecord] = result.curve
    return _figures(rows, args, stamps, base, [r.loss for r in curve])


def run_trl(rows: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from services.embedded.warmstart.train import load_for_training
    from spade.inference.models import ensure_default_model

    torch.set_num_threads(args.threads)
    model, tokenizer = load_for_training(ensure_default_model())
    data = Dataset.from_list(
        [{"input_ids": r["prompt"] + r["answer"], "labels": [-100] * len(r["prompt"]) + r["answer"]} for r in rows]
    )
    stamps: list[tuple[float, float]] = []
    losses: list[float] = []

    class Clock(TrainerCallback):
        def on_train_begin(self, *a: Any, **k: Any) -> None:
            stamps.append((time.perf_counter(), time.process_time()))

        def on_step_end(self, *a: Any, **k: Any) -> None:
            stamps.append((time.perf_counter(), time.process_time()))

        def on_log(self, *a: Any, **k: Any) -> None:
            logs = k.get("logs") or {}
            if "loss" in logs:
                losses.append(float(logs["loss"]))

    with tempfile.TemporaryDirectory() as out:
        config = SFTConfig(
            output_dir=out,
            per_device_train_batch_size=1,
            gradient_accumulation_steps=args.batch,
            learning_rate=1e-4,
            lr_scheduler_type="linear",
            warmup_steps=0,
            weight_decay=0.0,
            max_grad_norm=1.0,
            num_train_epochs=1,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            bf16=False,
            seed=0,
            max_length=None,
            dataloader_num_workers=0,
            disable_tqdm=True,
        )
        trainer = SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer)
        trainer.add_callback(Clock())
        _reset_peak()
        base = _status_kib("VmRSS")
        trainer.train()
    return _figures(rows, args, stamps, base, losses)


def _figures(
    rows: list[dict[str, Any]],
    args: argparse.Namespace,
    stamps: list[tuple[float, float]],
    base: int,
    losses: list[float],
) -> dict[str, Any]:
    # stamps: the start, then one per optimiser step; the first step is the warm-up.
    warm_end, last = stamps[1], stamps[-1]
    timed_steps = len(stamps) - 2
    mean_len = sum(len(r["prompt"]) + len(r["answer"]) for r in rows) / len(rows)
    tokens = timed_steps * args.batch * mean_len
    wall, cpu = last[0] - warm_end[0], last[1] - warm_end[1]
    return {
        "timed_steps": timed_steps,
        "tokens": round(tokens),
        "wall_s": round(wall, 1),
        "tokens_per_s": round(tokens / wall, 1),
        "tokens_per_cpu_s": round(tokens / cpu, 1),
        "peak_mib": round((_status_kib("VmHWM") - base) / 1024),
        "losses": [round(x, 4) for x in losses],
    }


def side(args: argparse.Namespace) -> None:
    rows = json.loads(Path(args.pairs_file).read_text())
    figures = run_trl(rows, args) if args.side == "trl" else run_loop(rows, args, prompt_gradient=args.side == "loop")
    print(json.dumps(figures))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2, help="Timed optimiser steps (after one warm-up step).")
    parser.add_argument("--batch", type=int, default=2, help="Pairs per optimiser step.")
    parser.add_argument("--prompt-tokens", type=int, default=1024, help="The designer prompt budget.")
    parser.add_argument("--threads", type=int, default=2, help="torch threads per side.")
    parser.add_argument("--sides", default=",".join(SIDES))
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--side", help=argparse.SUPPRESS)
    parser.add_argument("--pairs-file", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        side(args)
        return
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        pairs_file = Path(tmp) / "pairs.json"
        build_pairs((args.steps + 1) * args.batch, args.prompt_tokens, pairs_file)
        results: dict[str, Any] = {}
        for name in args.sides.split(","):
            command = [sys.executable, __file__, "--side", name, "--pairs-file", str(pairs_file)]
            command += ["--steps", str(args.steps), "--batch", str(args.batch), "--threads", str(args.threads)]
            env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
            done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, check=False)
            if done.returncode != 0:
                results[name] = {"error": done.stderr.strip().splitlines()[-3:]}
                continue
            results[name] = json.loads(done.stdout.strip().splitlines()[-1])
    report = {
        "settings": {k: getattr(args, k) for k in ("steps", "batch", "prompt_tokens", "threads")},
        "loadavg": load,
        "sides": results,
    }
    if args.json:
        print(json.dumps(report))
        return
    print(f"load average at start: {load[0]:.1f}")
    for name, figures in results.items():
        print(f"{name:>13}: {figures}")


if __name__ == "__main__":
    main()
