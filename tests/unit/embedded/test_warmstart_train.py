"""The warm start's SFT: the loss covers exactly the answer tokens (and EOS), computed only where the
answer is, and a few steps lower it (on a tiny random Llama; the real model is trained in
``tests/integration/warmstart/``)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
import torch

from services.embedded.warmstart.train import (
    IGNORE,
    SFTConfig,
    answer_loss,
    answer_nll,
    schedule,
    train,
    training_sequence,
)

# Tiny torch models are trained here: the model tier (tests/conftest.py), out of make test-fast.
pytestmark = pytest.mark.model


@pytest.fixture
def tiny_model() -> Iterator[torch.nn.Module]:
    from transformers import LlamaConfig, LlamaForCausalLM

    # One thread: a tiny model's ops are too small to share, and on a busy machine the threads wait on each other.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    yield LlamaForCausalLM(config).eval()
    torch.set_num_threads(threads)


def test_the_loss_mask_covers_exactly_the_answer_tokens_and_eos() -> None:
    prompt, answer = [11, 12, 13, 14], [21, 22, 23, 2]
    sequence = training_sequence(prompt, answer)
    assert sequence.input_ids == (*prompt, *answer)
    trained = [i for i, label in enumerate(sequence.labels) if label != IGNORE]
    assert trained == list(range(len(prompt), len(prompt) + len(answer)))
    assert [sequence.labels[i] for i in trained] == answer  # EOS (2) included
    assert sequence.answer_len == len(answer)
    with pytest.raises(ValueError):
        training_sequence([], answer)


@pytest.mark.parametrize("prompt_gradient", [True, False])
def test_answer_nll_is_the_mean_loss_over_exactly_the_labelled_tokens(
    tiny_model: torch.nn.Module, prompt_gradient: bool
) -> None:
    sequence = training_sequence([5, 6, 7, 8, 9, 10], [30, 31, 32, 2])
    nll, count = answer_nll(tiny_model, sequence, prompt_gradient=prompt_gradient)
    ids = torch.tensor([sequence.input_ids])
    labels = torch.tensor([sequence.labels])
    # transformers' own loss with -100 on the prompt: the mean over the labelled (shifted) positions.
    reference = tiny_model(input_ids=ids, labels=labels).loss
    assert count == 4
    assert float(nll.detach()) / count == pytest.approx(float(reference.detach()), rel=1e-5)
    # The prompt's tokens do not enter the loss: changing the last answer token changes it, the
    # labels of the prompt are never read.
    other = training_sequence([5, 6, 7, 8, 9, 10], [30, 31, 33, 2])
    assert float(answer_nll(tiny_model, other)[0].detach()) != pytest.approx(float(nll.detach()))


def test_a_few_steps_lower_the_answer_loss_and_every_step_is_recorded(tiny_model: torch.nn.Module) -> None:
    sequences = [training_sequence([5, 6, 7, 8], [40, 41, 42, 2]), training_sequence([9, 8, 7], [50, 51, 2])]
    before = answer_loss(tiny_model, sequences)
    result = train(tiny_model, sequences, SFTConfig(epochs=4, lr=1e-2, batch_size=2, warmup_steps=0))
    after = answer_loss(tiny_model, sequences)
    assert after < before - 0.5
    assert result.steps == 4 and len(result.curve) == 4
    assert result.answer_tokens == 4 * 7 and result.tokens == 4 * 14
    assert result.epoch_loss(0) == pytest.approx(result.curve[0].loss)


def test_cpu_bf16_multiplies_in_bf16_keeps_fp32_weights_and_still_learns(tiny_model: torch.nn.Module) -> None:
    sequences = [training_sequence([5, 6, 7, 8], [40, 41, 42, 2]), training_sequence([9, 8, 7], [50, 51, 2])]
    dtypes: set[torch.dtype] = set()
    down = tiny_model.get_submodule("model.layers.0.mlp.down_proj")
    hook = down.register_forward_hook(lambda m, i, o: dtypes.add(o.dtype))
    before = answer_loss(tiny_model, sequences)
    train(tiny_model, sequences, SFTConfig(epochs=4, lr=1e-2, batch_size=2, warmup_steps=0, cpu_bf16=True))
    hook.remove()
    assert torch.bfloat16 in dtypes  # the training passes (the loss probes above and below run in fp32)
    assert {p.dtype for p in tiny_model.parameters()} == {torch.float32}
    assert answer_loss(tiny_model, sequences) < before - 0.5


def test_training_is_seeded(tiny_model: torch.nn.Module) -> None:
    sequences = [training_sequence([5, 6, 7, 8], [40, 41, 42, 2]), training_sequence([9, 8, 7], [50, 51, 2])]
    state = {k: v.clone() for k, v in tiny_model.state_dict().items()}
    config = SFTConfig(epochs=2, lr=1e-2, batch_size=1, warmup_steps=1, seed=3)
    first = [r.loss for r in train(tiny_model, sequences, config).curve]
    tiny_model.load_state_dict(state)
    second = [r.loss for r in train(tiny_model, sequences, config).curve]
    assert first == second


def test_the_schedule_warms_up_then_decays_to_zero() -> None:
    factors = [schedule(s, 10, 2) for s in range(10)]
    assert factors[:2] == [1 / 3, 2 / 3]
    assert factors[2] == 1.0
    assert all(a > b for a, b in itertools.pairwise(factors[2:]))
    assert schedule(10, 10, 2) == 0.0
