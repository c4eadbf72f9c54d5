"""Supervised fine-tuning of the designer role: the loss on the answer tokens (and EOS) only.

A plain torch loop on CPU (chosen over TRL's ``SFTTrainer`` by ``bench/warmstart_bench.py``; see
docs/warmstart.md): one unpadded sequence per forward (``prompt_ids + answer_ids``), gradients
accumulated over ``batch_size`` pairs, the loss the token mean of the batch's answer tokens, AdamW
with a linear warm-up and a linear decay to 0, the global gradient norm clipped. Only the answer's
positions reach the LM head (``logits_to_keep``): the answer is the sequence's suffix, so the
prompt's logits are never computed.

With ``prompt_gradient=False`` the prompt runs without gradient and its keys and values are the
fixed context of the answer's forward (a KV cache): about 1.8 times cheaper on a 900-token prompt,
but the gradient no longer flows through the prompt's representations.

Everything is seeded (the order of the pairs, torch), so the same pairs and settings give the same
weights on the same machine.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from spade import training

IGNORE = -100
"""Label of a position the loss does not cover (the prompt's)."""


@dataclass(frozen=True)
class SFTConfig:
    """The SFT's knobs (from ``WarmStartSettings``).

    Attributes:
        epochs: Passes over the pairs.
        lr: Peak learning rate.
        batch_size: Pairs per optimiser step.
        weight_decay: AdamW weight decay.
        grad_clip: Global gradient-norm clip.
        warmup_steps: Linear warm-up steps (then linear decay to 0 at the last step).
        prompt_gradient: Back-propagate through the prompt's positions (exact); False treats the
            prompt as fixed context (cheaper, approximate).
        seed: Seeds the order of the pairs and torch.
        cpu_bf16: The passes under bf16 autocast on the CPU (fp32 weights, gradients and AdamW state).
    """

    epochs: int = 2
    lr: float = 1e-4
    batch_size: int = 2
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    warmup_steps: int = 2
    prompt_gradient: bool = True
    seed: int = 0
    cpu_bf16: bool = False


@dataclass(frozen=True)
class TrainingSequence:
    """One training sequence: the token ids and, per position, the label the loss compares with.

    Attributes:
        input_ids: ``prompt_ids + answer_ids``.
        labels: ``IGNORE`` on the prompt's positions, the token itself on the answer's (EOS included);
            position ``t``'s label is predicted from positions ``< t``.
        prompt_len: Length of the prompt.
    """

    input_ids: tuple[int, ...]
    labels: tuple[int, ...]
    prompt_len: int

    @property
    def answer_len(self) -> int:
        """Tokens the loss covers."""
        return len(self.input_ids) - self.prompt_len


def training_sequence(prompt_ids: Sequence[int], answer_ids: Sequence[int]) -> TrainingSequence:
    """The sequence of one pair, the loss masked to the answer tokens (and its EOS).

    >>> s = training_sequence([5, 6, 7], [8, 2])
    >>> s.input_ids, s.labels
    ((5, 6, 7, 8, 2), (-100, -100, -100, 8, 2))
    """
    if not prompt_ids or not answer_ids:
        raise ValueError("a training sequence needs a prompt and an answer")
    prompt, answer = tuple(int(t) for t in prompt_ids), tuple(int(t) for t in answer_ids)
    return TrainingSequence(input_ids=prompt + answer, labels=(IGNORE,) * len(prompt) + answer, prompt_len=len(prompt))


def answer_nll(
    model: nn.Module, sequence: TrainingSequence, *, prompt_gradient: bool = True
) -> tuple[torch.Tensor, int]:
    """Summed negative log-likelihood of the answer tokens given the prompt, and their count.

    The labelled positions are the sequence's suffix, so only the last ``answer_len`` positions of
    the shifted input reach the LM head. With ``prompt_gradient=False`` the prompt (but its last
    token, which predicts the first answer token) runs under ``no_grad`` into a KV cache.
    """
    ids = torch.tensor([sequence.input_ids], dtype=torch.long)
    targets = ids[0, sequence.prompt_len :]
    count = targets.numel()
    if prompt_gradient:
        logits = model(input_ids=ids[:, :-1], logits_to_keep=count, use_cache=False).logits[0]
    else:
        cut = sequence.prompt_len - 1
        with torch.no_grad():
            cache = model(input_ids=ids[:, :cut], use_cache=True).cache if cut > 0 else None
        logits = model(input_ids=ids[:, cut:-1], cache=cache, use_cache=cache is not None).logits[0]
    nll = nn.functional.cross_entropy(logits.float(), targets, reduction="sum")
    return nll, count


def answer_loss(model: nn.Module, sequences: Sequence[TrainingSequence]) -> float:
    """Mean per-token NLL of the answers of ``sequences`` (no gradient)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for sequence in sequences:
            nll, n = answer_nll(model, sequence)
            total += float(nll)
            count += n
    model.train(was_training)
    return total / max(count, 1)


@dataclass
class StepRecord:
    """One optimiser step."""

    step: int
    epoch: int
    loss: float
    grad_norm: float
    lr: float
    tokens: int
    seconds: float


@dataclass
class SFTResult:
    """What the SFT did.

    Attributes:
        steps: Optimiser steps.
        epochs: Passes over the pairs.
        sequences: Pairs trained on (per epoch).
        tokens: Tokens forwarded (prompts and answers, all epochs).
        answer_tokens: Tokens the loss covered (all epochs).
        wall_s: Seconds of the training loop.
        curve: Each step's record.
    """

    steps: int = 0
    epochs: int = 0
    sequences: int = 0
    tokens: int = 0
    answer_tokens: int = 0
    wall_s: float = 0.0
    curve: list[StepRecord] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        """Forwarded tokens per second of training."""
        return self.tokens / self.wall_s if self.wall_s else 0.0

    def epoch_loss(self, epoch: int) -> float | None:
        """Token-weighted mean training loss of ``epoch`` (the first epoch's is the loss before training)."""
        rows = [r for r in self.curve if r.epoch == epoch]
        tokens = sum(r.tokens for r in rows)
        return sum(r.loss * r.tokens for r in rows) / tokens if tokens else None

    def to_dict(self) -> dict[str, Any]:
        """For ``warmstart.json``."""
        return {
            "steps": self.steps,
            "epochs": self.epochs,
            "sequences": self.sequences,
            "tokens": self.tokens,
            "answer_tokens": self.answer_tokens,
            "wall_s": round(self.wall_s, 1),
            "tokens_per_s": round(self.tokens_per_s, 1),
            "epoch_loss": [self.epoch_loss(e) for e in range(self.epochs)],
            "curve": [
                {k: round(v, 5) if isinstance(v, float) else v for k, v in asdict(r).items()} for r in self.curve
            ],
        }


def seed_everything(seed: int) -> None:
    """Seed Python's and torch's generators."""
    random.seed(seed)
    torch.manual_seed(seed)


def _adamw(model: nn.Module, config: SFTConfig) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return training.adamw(params, lr=config.lr, weight_decay=config.weight_decay)


def schedule(step: int, total: int, warmup: int) -> float:
    """The learning-rate factor at ``step`` (0-based): linear warm-up, then linear decay to 0 at ``total``.

    >>> [round(schedule(s, 4, 1), 2) for s in range(4)]
    [1.0, 0.75, 0.5, 0.25]
    """
    if step < warmup:
        return (step + 1) / (warmup + 1)
    return max(0.0, (total - step) / max(1, total - warmup))


def train(
    model: nn.Module,
    sequences: Sequence[TrainingSequence],
    config: SFTConfig,
    *,
    progress: Callable[[str, float, float], None] | None = None,
) -> SFTResult:
    """Fine-tune ``model`` in place on ``sequences`` (loss on the answers only).

    Args:
        model: A causal LM (float32 on CPU).
        sequences: The pairs' sequences.
        config: Epochs, optimiser and schedule.
        progress: Called after each optimiser step (phase ``"train"``).
    """
    if not sequences:
        raise ValueError("no training sequence: the warm start needs at least one valid pair")
    seed_everything(config.seed)
    model.train()
    optimizer = _adamw(model, config)
    per_epoch = math.ceil(len(sequences) / config.batch_size)
    total = per_epoch * config.epochs
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: schedule(s, total, config.warmup_steps))
    order_rng = random.Random(f"warmstart-order/{config.seed}")
    result = SFTResult(epochs=config.epochs, sequences=len(sequences))
    start = time.perf_counter()
    if progress is not None:
        progress("train", 0, total)
    for epoch in range(config.epochs):
        order = list(range(len(sequences)))
        order_rng.shuffle(order)
        for first in range(0, len(order), config.batch_size):
            began = time.perf_counter()
            batch = [sequences[i] for i in order[first : first + config.batch_size]]
            batch_tokens = sum(s.answer_len for s in batch)
            loss_sum = 0.0
            for sequence in batch:
                with training.autocast(torch.device("cpu"), config.cpu_bf16):
                    nll, _ = answer_nll(model, sequence, prompt_gradient=config.prompt_gradient)
                (nll / batch_tokens).backward()
                loss_sum += float(nll.detach())
            norm = float(nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip))
            lr = optimizer.param_groups[0]["lr"]
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            result.steps += 1
            result.tokens += sum(len(s.input_ids) for s in batch)
            result.answer_tokens += batch_tokens
            result.curve.append(
                StepRecord(
                    step=result.steps,
                    epoch=epoch,
                    loss=loss_sum / batch_tokens,
                    grad_norm=norm,
                    lr=lr,
                    tokens=batch_tokens,
                    seconds=time.perf_counter() - began,
                )
            )
            if progress is not None:
                progress("train", result.steps, total)
    result.wall_s = time.perf_counter() - start
    model.eval()
    return result


def load_for_training(path: Path) -> tuple[nn.Module, Any]:
    """The checkpoint at ``path`` in float32 for training, and its tokenizer (as the learner loads it)."""
    from spade.inference.models import load_tokenizer, offline

    offline()
    from transformers import AutoModelForCausalLM

    from spade import cpu_linear

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, local_files_only=True)
    cpu_linear.use_onednn_linears(model)  # fp32 products through oneDNN, as the learner multiplies
    return model, load_tokenizer(path)


def save_checkpoint(model: Any, tokenizer: Any, directory: Path) -> Path:
    """Write ``model`` and ``tokenizer`` as an ordinary Hugging Face checkpoint (usable as ``model_path``)."""
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(directory), safe_serialization=True)
    tokenizer.save_pretrained(str(directory))
    for path in directory.iterdir():  # the model cache is readable like any other (safetensors writes 0600)
        if path.is_file():
            path.chmod(0o644)
    return directory
