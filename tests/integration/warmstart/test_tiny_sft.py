"""A tiny warm start on the real SmolLM2-135M: two steps on two real designer prompts with family
answers lower the answer loss on those pairs, and the result is an ordinary checkpoint the rest of
the system loads as ``model_path``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.designer.core.prompts import AgentBudget, fit_prompt
from services.designer.wiring import load_examples
from services.embedded.warmstart.data import PairConfig, answer_ids, plan_pairs, prompt_parts
from services.embedded.warmstart.train import (
    SFTConfig,
    answer_loss,
    load_for_training,
    save_checkpoint,
    train,
    training_sequence,
)
from spade.envs.families import training_families
from spade.inference.answer_format import designer_answer
from spade.inference.chat import ChatFormatter
from spade.inference.models import ensure_default_model, load_model, load_tokenizer, resolve_model_path
from tests.unit.embedded.warmstart_helpers import documents

pytestmark = [pytest.mark.model, pytest.mark.slow, pytest.mark.timeout(1200)]


def test_two_steps_on_two_pairs_lower_the_answer_loss_and_save_a_loadable_checkpoint(tmp_path: Path) -> None:
    base = ensure_default_model()
    formatter = ChatFormatter.from_pretrained(base)
    # The smallest budget the contract fits in: no document, no example, so the steps stay cheap.
    config = PairConfig(count=2, max_prompt_tokens=620, budget=AgentBudget(3, 48))
    planned = plan_pairs(config, families=training_families(), documents=documents(4), examples=load_examples("game"))
    sequences = []
    for item in planned:
        fitted = fit_prompt(prompt_parts(config, item), formatter.apply, max_prompt_tokens=config.max_prompt_tokens)
        sequences.append(
            training_sequence(
                fitted.prompt_ids, answer_ids(designer_answer(item.env.code, item.env.hint), formatter.tokenizer)
            )
        )

    model, tokenizer = load_for_training(base)
    before = answer_loss(model, sequences)
    result = train(model, sequences, SFTConfig(epochs=2, batch_size=2, lr=2e-4, warmup_steps=0))
    after = answer_loss(model, sequences)
    assert result.steps == 2
    assert after < before - 0.05, (before, after)

    out = save_checkpoint(model, tokenizer, tmp_path / "warm")
    assert resolve_model_path(out) == out  # a checkpoint directory the run accepts as model_path
    served = load_model(out)  # as the inference server loads it
    assert load_tokenizer(out).encode("class AEnv:") == tokenizer.encode("class AEnv:")
    assert answer_loss(served, sequences) == pytest.approx(after, rel=1e-4)
    trained = dict(model.named_parameters())
    for name, param in served.named_parameters():
        assert torch.equal(param, trained[name]), name
